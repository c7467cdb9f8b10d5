"""Planted slow bugs (test fixtures): each is the reference with one K1 detail done the way a
kernel might get it wrong, small enough to hide in a single step and growing over many.

- `DECAY`: the decay is exp(gate)·(1 + 2⁻¹⁰) (the recurrence is fed gate + log1p(2⁻¹⁰));
- `BF16_STATE`: every recurrent-state slot written is stored through bf16;
- `UNWRITTEN_SLOT`: the state after the second speculative token (st_idx[r, 1], an intermediate
  slot when L ≥ 3) is never written: the slot keeps what it held;
- `CONV_SHIFT_ACC1`: the conv window is shifted (the slot rewritten) only for requests with
  num_acc = 1; other requests' conv slots keep what they held.

The wrong detail is applied around the reference's own composition (`ref.kda_pre` with `feed=`
for the gate, or a fix-up of the slots it wrote), so everything else is the reference.
"""
from __future__ import annotations

import math

import torch

import ref
from fast.ref_backend import RefBackend


class _Bug(RefBackend):
    name = "bug"


def _live_rows(a) -> list[int]:
    st, na = a["st_idx"].cpu(), a["num_acc"].cpu()
    return [r for r in range(st.shape[0]) if int(st[r, int(na[r]) - 1]) > 0]


class DecayGain(_Bug):
    name = "bug-decay-gain"
    GAIN = 1.0 + 2.0 ** -10

    def kda_pre(self, key, taps=None, **a):
        probe = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in a.items()}
        t: dict = {}
        ref.kda_pre(key, **probe, taps=t)  # the gate the stage computes, on copies
        gate = t["gate"] + math.log(self.GAIN)  # decay = exp(gate)·GAIN
        out = {} if taps is None else taps
        ref.kda_pre(key, **a, taps=out, feed={"gate": gate})
        out["gate"] = gate


class Bf16State(_Bug):
    name = "bug-bf16-state"

    def kda_pre(self, key, **a):
        ref.kda_pre(key, **a)
        st, L = a["st_idx"], key.qlen
        for r in _live_rows(a):
            for j in range(L):
                s = int(st[r, j])
                if s > 0:
                    a["rstate"][s] = a["rstate"][s].to(torch.bfloat16).to(a["rstate"].dtype)


class UnwrittenSlot(_Bug):
    name = "bug-unwritten-slot"
    J = 1  # the slot of the state after token j = 1

    def kda_pre(self, key, **a):
        st = a["st_idx"]
        keep = {}
        for r in _live_rows(a):
            s = int(st[r, self.J])
            if s > 0:
                keep[s] = a["rstate"][s].clone()
        ref.kda_pre(key, **a)
        for s, v in keep.items():
            a["rstate"][s] = v


class ConvShiftAcc1(_Bug):
    name = "bug-conv-shift-acc1"

    def kda_pre(self, key, **a):
        st, na = a["st_idx"].cpu(), a["num_acc"].cpu()
        keep = {}
        for r in range(st.shape[0]):
            sc = int(st[r, 0])
            if sc > 0 and int(na[r]) != 1:
                keep[sc] = a["conv_state"][sc].clone()
        ref.kda_pre(key, **a)
        for s, v in keep.items():
            a["conv_state"][s] = v


DECAY = DecayGain()
BF16_STATE = Bf16State()
UNWRITTEN_SLOT = UnwrittenSlot()
CONV_SHIFT_ACC1 = ConvShiftAcc1()
BUGS = {b.name: b for b in (DECAY, BF16_STATE, UNWRITTEN_SLOT, CONV_SHIFT_ACC1)}
