"""Planted-bug backends: the reference with one stage implemented the way a kernel author might
get it wrong, and benign variants that a correct kernel may legitimately be.

A mutant loads `ref/kda_pre.py` and `ref/k2_launch.py` a second time as private modules and
replaces one stage function in their namespace, so the wrong value flows downstream and the
taps report it, exactly as a fused kernel with that bug would; the reference itself is never
touched. Each mutant names the stage the harness must blame (`born`: (stage, output)).
"""
from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import torch

import ref
from ref.comm import SimWorld

from fast.ref_backend import RefBackend

REF = Path(ref.__file__).resolve().parent
_ids = itertools.count()
BF16 = torch.bfloat16


def _private(name: str):
    """A fresh copy of ref/<name>.py as its own module (its globals can be patched safely)."""
    spec = importlib.util.spec_from_file_location(f"ref._planted_{name}_{next(_ids)}", REF / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "ref"
    spec.loader.exec_module(mod)
    return mod


class Mutant(RefBackend):
    """The reference with `k1` / `k2` patches ({global name: wrapper(real) -> replacement})."""

    def __init__(self, name: str, born, k1=None, k2=None, benign: bool = False, needs=None, doc: str = ""):
        self.name, self.born, self.benign, self.needs, self.doc = name, born, benign, needs or {}, doc
        self._k1 = _private("kda_pre")
        self._k2 = _private("k2_launch")
        for mod, patches in ((self._k1, k1 or {}), (self._k2, k2 or {})):
            for g, wrap in patches.items():
                setattr(mod, g, wrap(getattr(mod, g)))

    def kda_pre(self, key, **a):
        self._k1.kda_pre(key, **a)

    def k2_launch(self, key, **a):
        self._k2.k2_launch(key, **a)

    def __repr__(self):
        return f"<planted {self.name}>"


# ---------------------------------------------------------------- stage variants

def _bf16_accumulating_mm(x, w, num, chunk=32):
    """x @ w^T with the running sum kept in bf16 (rounded after every 32-wide chunk)."""
    acc = None
    for lo in range(0, x.shape[1], chunk):
        part = num.mm(x[:, lo:lo + chunk], w[:, lo:lo + chunk])
        acc = num.bf(part if acc is None else num.f(acc) + part)
    return num.f(acc)


def _padding_rows(st_idx, num_acc, qlen):
    L = qlen
    rows = []
    for r, (row, a) in enumerate(zip(st_idx[:, :L].tolist(), num_acc.tolist())):
        if row[a - 1] <= 0:
            rows += range(r * L, (r + 1) * L)
    return rows


def _conv_skip_padding(real):
    def short_conv(x, conv_w, conv_state, st_idx, num_acc, qlen, num):
        out = real(x, conv_w, conv_state, st_idx, num_acc, qlen, num)
        rows = _padding_rows(st_idx, num_acc, qlen)
        if rows:
            out[rows] = 0  # vLLM's kernels return early on padding slots: nothing computed there
        return out

    return short_conv


def _conv_gain_real_rows(real):
    def short_conv(x, conv_w, conv_state, st_idx, num_acc, qlen, num):
        out = real(x, conv_w, conv_state, st_idx, num_acc, qlen, num)
        pad = set(_padding_rows(st_idx, num_acc, qlen))
        rows = [t for t in range(out.shape[0]) if t not in pad]
        out[rows] = num.bf(num.f(out[rows]) * 1.05)
        return out

    return short_conv


def _conv_window_full_accept(real):
    """Reads the window of a = L at a-2: wrong only when a request accepted every token."""
    def short_conv(x, conv_w, conv_state, st_idx, num_acc, qlen, num):
        return real(x, conv_w, conv_state, st_idx, num_acc.clamp(max=max(1, qlen - 1)), qlen, num)

    return short_conv


def _state_through_bf16(real):
    def kda_recurrence(q, k, v, gate, beta, rstate, st_idx, num_acc, qlen, num):
        o = real(q, k, v, gate, beta, rstate, st_idx, num_acc, qlen, num)
        for r, (row, a) in enumerate(zip(st_idx[:, :qlen].tolist(), num_acc.tolist())):
            if row[a - 1] > 0:
                for s in {s for s in row if s > 0}:
                    rstate[s] = rstate[s].to(BF16).to(rstate.dtype)
        return o

    return kda_recurrence


def _stale_slot(real):
    """Skips the state write of the last speculative slot of the first real request."""
    def kda_recurrence(q, k, v, gate, beta, rstate, st_idx, num_acc, qlen, num):
        keep = None
        for row, a in zip(st_idx[:, :qlen].tolist(), num_acc.tolist()):
            if row[a - 1] > 0 and row[-1] > 0:
                keep = (row[-1], rstate[row[-1]].clone())
                break
        o = real(q, k, v, gate, beta, rstate, st_idx, num_acc, qlen, num)
        if keep is not None:
            rstate[keep[0]] = keep[1]
        return o

    return kda_recurrence


def _tie_to_higher_id(real):
    def select(logits, bias, topk, force_ids=None):
        if force_ids is not None:
            return real(logits, bias, topk, force_ids)
        E = logits.shape[-1]
        ids, w = real(logits.flip(-1), bias.flip(-1), topk)
        return (E - 1 - ids.long()).to(torch.int32), w

    return select


def _ignore_bias(real):
    def select(logits, bias, topk, force_ids=None):
        return real(logits, torch.zeros_like(bias), topk, force_ids)

    return select


def _experts_fp32_sum(real):
    """Per-pick contributions summed in fp32 and rounded once (not one rounding per add)."""
    def routed_experts(lat, ids, weights, w13, w13s, w2, w2s, fmt, beta, lam, num):
        parts = [num.f(real(lat, ids[:, k:k + 1], weights[:, k:k + 1], w13, w13s, w2, w2s, fmt, beta, lam, num))
                 for k in range(ids.shape[1])]
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return num.bf(acc)

    return routed_experts


def _experts_reversed(real):
    def routed_experts(lat, ids, weights, *a):
        return real(lat, ids.flip(1), weights.flip(1), *a)

    return routed_experts


def _experts_gain(real):
    def routed_experts(lat, ids, weights, *a):
        return real(lat, ids, weights * 1.01, *a)

    return routed_experts


def _eps(value):
    def wrap(real):
        def norm(x, w, eps, num):
            return real(x, w, value, num)

        return norm

    return wrap


def _extra_round(real):
    def attnres(v, nw, qk, eps, num):
        return num.f(num.bf(real(v, nw, qk, eps, num)))

    return attnres


def _unrounded_partial(real):
    def o_proj_partial(core, w_o, num):
        return num.mm(core, w_o)

    return o_proj_partial


def _in_proj_bf16(real):
    def in_proj(x, w_in, num):
        return num.bf(_bf16_accumulating_mm(x, w_in, num))

    return in_proj


def _shared_h_unrounded(real):
    from ref.shared_expert import situ

    def shared_expert(x, w_sgu, w_sd, beta, lam, num):
        gu = num.bf(num.mm(x, w_sgu))
        si = gu.shape[1] // 2
        h = situ(num.f(gu[:, :si]), num.f(gu[:, si:]), beta, lam)  # h left in fp32: a missing rounding
        return num.bf(num.mm(h, w_sd))

    return shared_expert


def _perturbed(seed):
    """A benign variant: the reference's own reduction orders permuted (a correct kernel)."""
    def wrap(real):
        def launch(*a, **kw):
            kw["perturb"] = seed
            return real(*a, **kw)

        return launch

    return wrap


# The eps of the tiny preset's AttnRes norm (the field a kernel may wrongly read for the others).
WRONG_EPS = 1e-5


def bugs() -> list[Mutant]:
    return [
        Mutant("in_proj_bf16_acc", ("k1", "proj"), k1={"in_proj": _in_proj_bf16},
               doc="in_proj accumulated in bf16"),
        Mutant("x_extra_round", ("k1", "x"), k1={"attnres": _extra_round},
               doc="AttnRes mix rounded to bf16 before the input norm"),
        Mutant("x_wrong_eps", ("k1", "x"), k1={"rmsnorm": _eps(WRONG_EPS)},
               doc="input norm reads the AttnRes eps field"),
        Mutant("conv_gain", ("k1", "conv_out"), k1={"short_conv": _conv_gain_real_rows},
               doc="short conv 5% high on the real rows"),
        Mutant("conv_window_full_accept", ("k1", "conv_out"), k1={"short_conv": _conv_window_full_accept},
               needs={"full_accept": True}, doc="conv window off by one when every token was accepted"),
        Mutant("state_bf16", ("k1", "rstate"), k1={"kda_recurrence": _state_through_bf16},
               doc="recurrent state stored through bf16"),
        Mutant("stale_slot", ("k1", "rstate"), k1={"kda_recurrence": _stale_slot},
               doc="one speculative state slot left unwritten"),
        Mutant("onorm_wrong_eps", ("k1", "core_out"), k1={"gated_rmsnorm": lambda real: (
            lambda o, g2, w, eps, num: real(o, g2, w, WRONG_EPS, num))}, doc="gated norm reads the wrong eps"),
        Mutant("o_proj_unrounded", ("k2", "delta"), k2={"o_proj_partial": _unrounded_partial},
               doc="o_proj partial not rounded before the all-reduce"),
        Mutant("post_norm_wrong_eps", ("k2", "x"), k2={"rmsnorm": _eps(WRONG_EPS * 3)},
               doc="post-attention norm reads the input norm's eps"),
        Mutant("tie_higher_id", ("k2", "topk_ids"), k2={"select": _tie_to_higher_id},
               needs={"ties": True}, doc="router ties broken to the higher expert id"),
        Mutant("router_no_bias", ("k2", "topk_ids"), k2={"select": _ignore_bias}, doc="router ignores the bias"),
        Mutant("experts_fp32_sum", ("k2", "y"), k2={"routed_experts": _experts_fp32_sum},
               doc="expert contributions summed in fp32, rounded once"),
        Mutant("experts_reversed", ("k2", "y"), k2={"routed_experts": _experts_reversed},
               doc="per-pick accumulation in reverse top-k order"),
        Mutant("experts_gain", ("k2", "y"), k2={"routed_experts": _experts_gain}, doc="routed weights 1% high"),
        Mutant("shared_h_unrounded", ("k2", "sh"), k2={"shared_expert": _shared_h_unrounded},
               doc="shared-expert h left in fp32"),
        Mutant("ln_wrong_eps", ("k2", "ln"), k2={"latent_norm": _eps(WRONG_EPS)},
               doc="latent norm reads the AttnRes eps field"),
    ]


def benign() -> list[Mutant]:
    return [
        Mutant("conv_skips_padding", None, k1={"short_conv": _conv_skip_padding}, benign=True,
               doc="short conv returns early for padding rows (as vLLM's kernels do)"),
        Mutant("reordered_1", None, k1={"kda_pre": _perturbed(1)}, k2={"k2_launch": _perturbed(1)}, benign=True,
               doc="split-K and reduction orders permuted (seed 1)"),
        Mutant("reordered_2", None, k1={"kda_pre": _perturbed(2)}, k2={"k2_launch": _perturbed(2)}, benign=True,
               doc="split-K and reduction orders permuted (seed 2)"),
    ]


class _Harmful(RefBackend):
    """The reference backend, with one fault added by each subclass."""


class Hung(_Harmful):
    """K1 never returns (a spin-wait that never sees its ticket)."""
    name = "hung"

    def __init__(self, seconds: float = 3600.0):
        self.seconds = seconds

    def kda_pre(self, key, **a):
        import time

        time.sleep(self.seconds)


class HungRank(_Harmful):
    """Rank 1's K2 never returns; the other ranks wait for it at the first reduction."""
    name = "hung-rank"

    def k2_launch(self, key, rank=0, **a):
        import time

        if rank == 1:
            time.sleep(3600)
        ref.k2_launch(key, rank=rank, **a)


class Scribbler(_Harmful):
    """Correct outputs, but it writes its scratch into an input weight."""
    name = "scribbler"

    def kda_pre(self, key, **a):
        ref.kda_pre(key, **a)
        a["w_in"][0, 0] = a["w_in"][0, 0] + 1


class Unhealthy(_Harmful):
    """Correct outputs, but its health check reports a timed-out spin-wait."""
    name = "unhealthy"

    def health(self):
        return ["k1 attnres+in_proj: ticket wait timed out (spin budget exhausted)"]


class BadTap(_Harmful):
    """Fills the `x` tap with a tensor of the wrong shape."""
    name = "bad-tap"

    def kda_pre(self, key, taps=None, **a):
        ref.kda_pre(key, taps=taps, **a)
        if taps is not None:
            taps["x"] = taps["x"][:, :-1]


__all__ = ["Mutant", "bugs", "benign", "Hung", "HungRank", "Scribbler", "Unhealthy", "BadTap", "SimWorld"]

HUNG, HUNG_RANK, SCRIBBLER, UNHEALTHY, BAD_TAP = Hung(), HungRank(), Scribbler(), Unhealthy(), BadTap()
