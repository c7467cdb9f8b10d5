"""Record captures around real launches (DESIGN §8): wrap any `kda_pre` / `k2_launch` pair of
the DESIGN §6 contract (a deployment's kernels or ours) and write one capture per
(step, layer, rank), inputs as the kernel saw them and what it wrote::

    rec = Recorder(backend.kda_pre, backend.k2_launch, "caps/", budget_bytes=2 << 30,
                   layers={3, 4}, steps=range(8), cfg=get_config("k3-tp8"))
    rec.kda_pre(key, **k1_kwargs)       # same signature, same effect, same return value
    rec.k2_launch(key, **k2_kwargs)
    rec.close()                          # -> summary dict

Pairing. K1 has no rank argument: a K1 call is held until the K2 call of the same layer
whose `core` is bit-identical to that K1's `core_out` (the o_proj input passes straight
through), and that K2's rank is the capture's rank. A K2 call with no matching K1 is an
MLA layer. Steps are numbered per (layer, rank) by K2 calls, unless the driver calls
`set_step(n)` before each step.

Budget. Before a (step, layer) set is written the recorder estimates its bytes (all ranks,
plus weight files it has not stored yet); a set that would exceed `budget_bytes` is
skipped whole, so no incomplete set is ever written. Skips are counted, never raised.

Thread-safe: SimWorld runs K2 ranks in threads; the wrapped launch runs outside the lock.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ref.config import Config

from . import capture as cap

_MAX_PENDING = 64  # K1 records held per layer waiting for their K2 (oldest dropped)


@dataclass
class _K1:
    key: object
    inp: dict
    after: dict
    weights: dict
    slot_map: torch.Tensor
    conv_slots: int
    rec_slots: int
    conv_layout: str
    core_sha: str


def _clone(t):
    return None if t is None else t.detach().clone()


def _want(sel, v) -> bool:
    return sel is None or v in sel


class Recorder:
    """Wraps a launch pair; `kda_pre` / `k2_launch` of this object are drop-in replacements."""

    def __init__(self, kda_pre, k2_launch, out_dir, budget_bytes: int, layers=None, steps=None,
                 cfg: Config | None = None, tool: str = "k3verify recorder", git: bool = True, quiet: bool = False):
        self._kda_pre, self._k2_launch = kda_pre, k2_launch
        self.out = Path(out_dir)
        self.budget = int(budget_bytes)
        self.layers = None if layers is None else set(layers)
        self.steps = None if steps is None else set(steps)
        self.cfg = cfg
        self.quiet = quiet
        self._tool, self._git = tool, git
        self._producer = None
        self._lock = threading.Lock()
        self._pending: dict[int, list[_K1]] = {}
        self._k2_count: dict[tuple[int, int], int] = {}
        self._decided: dict[tuple[int, int], bool] = {}
        self._stored: set[str] = set()
        self._hasher = cap.WeightHasher()
        self._step: int | None = None
        self.used = 0
        self.written: list[Path] = []
        self.skipped = 0
        self.warnings: list[str] = []

    # ---- driver hooks
    def set_step(self, n: int | None) -> None:
        """Number the following launches as step n (None: count K2 calls per layer and rank)."""
        self._step = n

    def close(self) -> dict:
        with self._lock:
            dropped = sum(len(v) for v in self._pending.values())
            self._pending.clear()
        return {"written": len(self.written), "sets": len({p.parent for p in self.written}),
                "skipped": self.skipped, "bytes": self.used, "unpaired_k1": dropped, "warnings": list(self.warnings)}

    # ---- wrapped launches
    def kda_pre(self, key, **kw):
        layer = kw.get("layer")
        if layer is None or not _want(self.layers, layer) or (self._step is not None
                                                              and not _want(self.steps, self._step)):
            return self._kda_pre(key, **kw)
        st_idx = kw["st_idx"]
        smap = cap.slot_map_for(st_idx, key.qlen)
        inp = {n: _clone(kw.get(n)) for n in ("prefix", "delta", "blocks", "st_idx", "num_acc")}
        inp["conv_state"] = cap.compact_cache(kw["conv_state"], smap)
        inp["rstate"] = cap.compact_cache(kw["rstate"], smap)
        res = self._kda_pre(key, **kw)
        after = {n: _clone(kw[n]) for n in ("prefix", "blocks", "core_out")}
        after["conv_state"] = cap.compact_cache(kw["conv_state"], smap)
        after["rstate"] = cap.compact_cache(kw["rstate"], smap)
        rec = _K1(key, inp, after, {n: kw.get(n) for n in cap.K1_WEIGHTS}, smap, kw["conv_state"].shape[0],
                  kw["rstate"].shape[0], cap.conv_layout_of(kw["conv_state"]), cap.tensor_sha256(kw["core_out"]))
        if self.cfg is not None and self.cfg.is_dense(layer):
            # no K2 follows on a dense layer: the ranks of one step call K1 in rank order
            with self._lock:
                n = self._k2_count.get((layer, -1), 0)
                self._k2_count[(layer, -1)] = n + 1
                world = self.cfg.world
                step = self._step if self._step is not None else n // world
                if _want(self.steps, step):
                    self._record(step, layer, n % world, world, None, None, None, None, rec)
            return res
        with self._lock:
            q = self._pending.setdefault(layer, [])
            q.append(rec)
            del q[:-_MAX_PENDING]
        return res

    def k2_launch(self, key, **kw):
        layer, rank, comm = kw.get("layer"), kw.get("rank", 0), kw.get("comm")
        if layer is None or not _want(self.layers, layer):
            return self._k2_launch(key, **kw)
        world = int(getattr(comm, "world", 1))
        with self._lock:
            if self._step is not None:
                step = self._step
            else:
                step = self._k2_count.get((layer, rank), 0)
                self._k2_count[(layer, rank)] = step + 1
        core_sha = cap.tensor_sha256(kw["core"])
        if not _want(self.steps, step):
            self._pop_k1(layer, core_sha)
            return self._k2_launch(key, **kw)
        inp = {n: _clone(kw[n]) for n in cap.K2_STATE}
        res = self._k2_launch(key, **kw)
        after = {n: _clone(kw[n]) for n in cap.K2_AFTER}
        k1 = self._pop_k1(layer, core_sha)
        weights = {n: kw.get(n) for n in cap.K2_WEIGHTS}
        with self._lock:
            self._record(step, layer, rank, world, key, inp, after, weights, k1)
        return res

    # ---- internals
    def _pop_k1(self, layer: int, core_sha: str) -> _K1 | None:
        with self._lock:
            q = self._pending.get(layer, [])
            for i, r in enumerate(q):
                if r.core_sha == core_sha:
                    return q.pop(i)
        return None

    def _warn(self, msg: str) -> None:
        self.warnings.append(msg)
        if not self.quiet:
            print(f"k3verify recorder: {msg}", file=sys.stderr)

    def _record(self, step, layer, rank, world, key, inp, after, weights, k1: _K1 | None) -> None:
        kind = "dense" if key is None else "kda" if k1 is not None else "mla"
        if self.cfg is not None and self.cfg.kind(layer) != kind:
            self._warn(f"step {step} layer {layer} rank {rank}: config says {self.cfg.kind(layer)}, "
                       f"recorded a {kind} launch sequence; not written")
            self.skipped += 1
            return
        tensors = list((inp or {}).values()) + list((after or {}).values())
        if k1 is not None:
            tensors += list(k1.inp.values()) + list(k1.after.values())
        est = sum(t.numel() * t.element_size() for t in tensors if t is not None) + 16384
        wsets = ([weights] if weights is not None else []) + ([k1.weights] if k1 is not None else [])
        new_w = 0
        entries = [self._hasher.entries(w) for w in wsets]
        addrs = [cap.weights_address(e) for e in entries]
        for a, w in zip(addrs, wsets):
            if a not in self._stored:
                new_w += sum(t.numel() * t.element_size() for t in w.values() if t is not None)
        sk = (step, layer)
        if sk not in self._decided:
            self._decided[sk] = self.used + est * world + new_w * world <= self.budget
            if not self._decided[sk]:
                self._warn(f"budget of {self.budget} bytes reached: step {step} layer {layer} not recorded")
        if not self._decided[sk]:
            self.skipped += 1
            return
        for a, w, e in zip(addrs, wsets, entries):
            if a not in self._stored:
                cap.store_weights(self.out, w, e)
                self._stored.add(a)
                self.used += (self.out / "weights" / f"{a}.safetensors").stat().st_size
        dev = next(t.device for t in tensors if t is not None)
        if self._producer is None:
            self._producer = cap.producer(self._tool, dev, git=self._git)
        rec = cap.StepRecord(step=step, layer=layer, rank=rank, world=world, kind=kind,
                             fmt=key.experts if key is not None else "bf16", k2_key=key, k2_in=inp,
                             k2_weights=addrs[0] if weights is not None else None, k2_after=after, cfg=self.cfg,
                             dims=None if self.cfg else _dims(inp, weights, k1), meta={"recorder": {}})
        if k1 is not None:
            rec.k1_key, rec.k1_in, rec.k1_after, rec.k1_weights = k1.key, k1.inp, k1.after, addrs[-1]
            rec.slot_map, rec.conv_slots, rec.rec_slots = k1.slot_map, k1.conv_slots, k1.rec_slots
            rec.conv_layout = k1.conv_layout
        path = cap.write_capture(self.out, rec, self._producer)
        self.used += path.stat().st_size
        self.written.append(path)


def _dims(inp: dict, w2: dict, k1: _K1 | None) -> dict:
    """Dims read off the tensors when the recorder has no Config (the manifest's config.dims)."""
    d = {"hidden": inp["prefix"].shape[1], "p": inp["core"].shape[1], "experts": w2["w_gate"].shape[0],
         "lat": w2["w_ld"].shape[0], "ri": w2["w13"].shape[1] // 2, "si": w2["w_sd"].shape[1],
         "up_n": w2["w_up"].shape[0], "nbmax": inp["blocks"].shape[1]}
    if k1 is not None:
        w1 = k1.weights
        d.update(nh=w1["a_log"].shape[0], hd=w1["on_w"].shape[0], rank=w1["w_fb"].shape[1],
                 conv=w1["conv_w"].shape[1], nproj=w1["w_in"].shape[0], qkv=w1["conv_w"].shape[0])
    return d
