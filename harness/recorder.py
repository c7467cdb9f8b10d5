"""Record captures around real launches (DESIGN §8, §12): wrap any `kda_pre` / `k2_launch`
pair of the DESIGN §6 contract (a deployment's kernels or ours) and write one capture per
(step, layer, rank): the inputs as the kernel saw them (taken before the launch), what it
wrote (taken after), caches compacted to the slots the step references::

    rec = Recorder(backend.kda_pre, backend.k2_launch, "caps/", budget_bytes=2 << 30,
                   layers={3, 4}, steps=range(8), cfg=get_config("k3-tp8"))
    rec.kda_pre(key, **k1_kwargs)       # same signature, same effect, same return value
    rec.k2_launch(key, **k2_kwargs)
    rec.close()                          # -> summary dict

A deployment wrapper that maps another ABI first (the vLLM plugin, `harness.vllm_plugin`)
calls `record_k1` / `record_k2` with k3verify's key and arguments and a `launch` thunk that
runs the real call unchanged: the recorder only reads tensors around it, so what the kernel
computes cannot change.

Two layouts:

- `per_rank=False` (in-process drivers, every rank in one process): complete capture sets
  under `out_dir` (`s00003_l002/rank0.safetensors`, weights in `out_dir/weights`).
- `per_rank=True` (serving: one process per TP rank): rank r writes `out_dir/rank{r}/` (its
  captures in the set layout, its weights, and `journal.jsonl`); `k3verify group` assembles
  the ranks into capture sets and reports what is incomplete (harness/group.py).

Ranks. `record_k1` / `record_k2` take the rank from the caller (the plugin asks the worker:
its TP rank, never the call order). The plain `kda_pre` wrapper has no rank: its K1 is held
until the K2 of the same layer whose `core` is bit-identical to that K1's `core_out` (the
o_proj input passes straight through), and that K2's rank is the capture's rank; a dense
layer's K1 (no K2 follows) takes the order in which the driver calls the ranks.

Steps. `begin_step(rank)` (the plugin calls it from vLLM's `step_begin`, once a forward)
numbers the forwards of a rank; `set_step(n)` numbers the following launches; otherwise a
layer's n-th launch on a rank is step n. A forward that began inside a CUDA-graph capture
(`begin_step(eager=False)`) is not recorded, nor is a second launch of one layer within one
forward (a graph replay's eager segment).

Budget. Bytes are counted from the tensors (identical on every rank, so every rank decides
alike). Steps are recorded whole: a step is not started when the previous step's size would
not fit ("stopped", not an error); when a capture does not fit after some of its step were
written, the step's captures are removed, the drop is said (warning; journal entry `dropped`,
which `k3verify group` reports) and recording stops. With per_rank the budget is per rank,
else for the whole process.

Weights are named through one object (`weights=`): `StoredWeights` copies them into the
content-addressed `weights/` folder; checkpoint references (DESIGN §8) plug in there.

Thread-safe: SimWorld runs K2 ranks in threads; the wrapped launch runs outside the lock.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ref.config import Config

from . import capture as cap

_MAX_PENDING = 64  # K1 records held per layer waiting for their K2 (oldest dropped)
_EST_MANIFEST = 16384  # bytes a capture's header and manifest take, at most


class Refused(Exception):
    """A launch the recorder will not record (the reason is journaled; the launch still runs)."""


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
    rank: int | None
    step: int | None
    meta: dict


@dataclass
class _Budget:
    """One budget's account (per rank, or the whole process)."""

    used: int = 0  # bytes of captures and weights written
    step: int | None = None  # the step being recorded
    step_bytes: int = 0  # capture bytes of that step so far
    last_step_bytes: int = 0  # capture bytes of the previous whole step
    files: list = field(default_factory=list)  # captures of that step
    stopped: bool = False
    dropped: set = field(default_factory=set)


@dataclass
class _Forward:
    """A rank's forward as `begin_step` numbered it."""

    step: int
    eager: bool
    seen: set = field(default_factory=set)  # (kernel, layer) launched in it


class StoredWeights:
    """Weights stored in ROOT/weights/<address>.safetensors (DESIGN §8 source 1, *stored*).

    The recorder names every weight set through `name`; a checkpoint-reference source (§8
    source 3) replaces this object. `expert_layout`: 'logical' (DESIGN §7), or the name of a
    pre-shuffled layout (vLLM's gfx950/gfx942 mono K2 receives AITER-shuffled experts), which
    this source refuses to store: a stored capture holds logical weights only."""

    def __init__(self, expert_layout: str = "logical"):
        self.expert_layout = expert_layout
        self._hasher = cap.WeightHasher()
        self._stored: set[str] = set()

    def name(self, root: Path, kernel: str, layer: int, rank: int, tensors: dict):
        """-> (address, bytes a commit will add, commit()); Refused when it cannot name them."""
        if kernel == "k2" and self.expert_layout != "logical" and tensors.get("w13s") is not None:
            raise Refused(f"expert weights arrive in the {self.expert_layout!r} layout; a stored capture holds the "
                          "logical layout of DESIGN §7 (name them by checkpoint reference instead, or set "
                          "K3VERIFY_RECORD_EXPERT_LAYOUT=logical for kernels that read logical weights)")
        entries = self._hasher.entries(tensors)
        addr = cap.weights_address(entries)
        new = 0 if (addr in self._stored or (Path(root) / "weights" / f"{addr}.safetensors").exists()) else \
            sum(t.numel() * t.element_size() for t in tensors.values() if t is not None)

        def commit():
            if addr not in self._stored:
                cap.store_weights(root, tensors, entries)
                self._stored.add(addr)

        return addr, new, commit


def _clone(t):
    return None if t is None else t.detach().clone()


def _want(sel, v) -> bool:
    return sel is None or v in sel


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


class Recorder:
    """Wraps a launch pair; `kda_pre` / `k2_launch` of this object are drop-in replacements."""

    def __init__(self, kda_pre, k2_launch, out_dir, budget_bytes: int, layers=None, steps=None,
                 cfg: Config | None = None, tool: str = "k3verify recorder", git: bool = True, quiet: bool = False,
                 per_rank: bool = False, weights: StoredWeights | None = None, world: int | None = None,
                 meta: dict | None = None):
        self._kda_pre, self._k2_launch = kda_pre, k2_launch
        self.out = Path(out_dir)
        self.budget = int(budget_bytes)
        self.layers = None if layers is None else set(layers)
        self.steps = None if steps is None else set(steps)
        self.cfg = cfg
        self.world = world if world is not None else (cfg.world if cfg is not None else None)
        self.quiet = quiet
        self.per_rank = per_rank
        self.weights = weights or StoredWeights()
        self._tool, self._git, self._meta = tool, git, dict(meta or {})
        self._producer = None
        self._lock = threading.Lock()
        self._pending: dict[int, list[_K1]] = {}
        self._counts: dict[tuple, int] = {}
        self._fwd: dict[int, _Forward] = {}
        self._budgets: dict[int | None, _Budget] = {}
        self._journals: dict[int, object] = {}
        self._step: int | None = None
        self.written: list[Path] = []
        self._skips: dict[int | None, dict[str, int]] = {}  # rank -> reason -> launches not recorded
        self.warnings: list[str] = []
        self._warned: set[str] = set()
        self._refused: set[tuple] = set()

    # ---- driver hooks
    def set_step(self, n: int | None) -> None:
        """Number the following launches as step n (None: count launches per layer and rank)."""
        self._step = n

    def begin_step(self, rank: int, eager: bool = True) -> int:
        """A rank's forward begins (vLLM's `step_begin`); eager=False inside a CUDA-graph capture.
        Returns the step number (the rank's forwards counted from 0)."""
        with self._lock:
            prev = self._fwd.get(rank)
            self._fwd[rank] = _Forward(0 if prev is None else prev.step + 1, eager)
            return self._fwd[rank].step

    @property
    def skipped(self) -> dict:
        """reason -> launches not recorded, every rank together."""
        out: dict[str, int] = {}
        for by in self._skips.values():
            for k, v in by.items():
                out[k] = out.get(k, 0) + v
        return out

    def _count(self, rank, reason: str) -> None:
        by = self._skips.setdefault(rank, {})
        by[reason] = by.get(reason, 0) + 1

    @property
    def used(self) -> int:
        return sum(b.used for b in self._budgets.values())

    def close(self) -> dict:
        with self._lock:
            dropped = sum(len(v) for v in self._pending.values())
            self._pending.clear()
            for r, j in self._journals.items():
                self._event(r, "close", skipped=dict(self._skips.get(r, {})), unpaired_k1=dropped)
                j.close()
            self._journals.clear()
        return {"written": len(self.written), "sets": len({p.parent for p in self.written}),
                "skipped": sum(self.skipped.values()), "skipped_by_reason": dict(self.skipped), "bytes": self.used,
                "unpaired_k1": dropped, "warnings": list(self.warnings)}

    # ---- the k3verify-contract wrappers (drop-in launches)
    def kda_pre(self, key, **kw):
        args = {n: kw.get(n) for n in cap.K1_STATE + cap.K1_WEIGHTS + ("core_out",)}
        return self.record_k1(key, args, lambda: self._kda_pre(key, **kw), layer=kw.get("layer"))

    def k2_launch(self, key, **kw):
        comm = kw.get("comm")
        args = {n: kw.get(n) for n in cap.K2_STATE + cap.K2_WEIGHTS + ("out",)}
        return self.record_k2(key, args, lambda: self._k2_launch(key, **kw), layer=kw.get("layer"),
                              rank=kw.get("rank", 0), world=int(getattr(comm, "world", 1)))

    # ---- recording around a launch
    def skip(self, reason: str, warn: str | None = None, rank: int | None = None):
        """Count a launch not recorded for a benign reason (once-per-reason warning if given)."""
        with self._lock:
            self._count(rank, reason)
            if warn and reason not in self._warned:
                self._warned.add(reason)
                self._warn(warn)

    def wants(self, layer: int) -> bool:
        return _want(self.layers, layer)

    def refuse(self, kernel: str, layer, rank, reason: str, step=None) -> None:
        """Journal a launch the recorder cannot record correctly (a bad recording: `group` reports it);
        one journal line per (kernel, layer, reason) and rank, the repeats counted."""
        with self._lock:
            self._refuse(kernel, layer, rank, reason, step)

    def _refuse(self, kernel: str, layer, rank, reason: str, step=None) -> None:
        self._count(rank, "refused")
        k = (kernel, layer, rank, reason)
        if k in self._refused:
            return
        self._refused.add(k)
        if rank is not None:
            self._event(rank, "refused", kernel=kernel, layer=layer, step=step, reason=reason)
        if reason not in self._warned:
            self._warned.add(reason)
            self._warn(f"{kernel} layer {layer} rank {rank}: not recorded: {reason}")

    def _step_of(self, kernel: str, layer: int, rank: int | None):
        """(step, why-not) of a launch; why-not is a skip reason or None."""
        if rank is not None and rank in self._fwd:
            f = self._fwd[rank]
            if not f.eager:
                return f.step, "graph"
            if (kernel, layer) in f.seen:
                return f.step, "graph"
            f.seen.add((kernel, layer))
            return f.step, None
        if self._step is not None:
            return self._step, None
        k = (kernel, layer, rank)
        n = self._counts.get(k, 0)
        self._counts[k] = n + 1
        return n, None

    def record_k1(self, key, args: dict, launch, *, layer, rank: int | None = None, meta: dict | None = None):
        """Run `launch()` (the real K1 call) with its inputs and outputs recorded. `args`: the
        launch's tensors under k3verify's K1 names (views of the real call's, not copies)."""
        if layer is None or not _want(self.layers, layer):
            return launch()
        dense = self.cfg is not None and self.cfg.is_dense(layer)
        with self._lock:
            step, why = self._step_of("k1", layer, rank) if rank is not None else (self._step, None)
        if why is not None:
            self.skip(why, "a launch outside an eager forward (CUDA-graph capture or replay) is not recorded", rank)
            return launch()
        if step is not None and not _want(self.steps, step):
            self.skip("filtered", rank=rank)
            return launch()
        if self._stopped(rank):
            self.skip("budget", rank=rank)
            return launch()
        st_idx = args["st_idx"]
        smap = cap.slot_map_for(st_idx, key.qlen)
        inp = {n: _clone(args.get(n)) for n in ("prefix", "delta", "blocks", "st_idx", "num_acc")}
        inp["conv_state"] = cap.compact_cache(args["conv_state"], smap)
        inp["rstate"] = cap.compact_cache(args["rstate"], smap)
        res = launch()
        after = {n: _clone(args[n]) for n in ("prefix", "blocks", "core_out")}
        after["conv_state"] = cap.compact_cache(args["conv_state"], smap)
        after["rstate"] = cap.compact_cache(args["rstate"], smap)
        rec = _K1(key, inp, after, {n: args.get(n) for n in cap.K1_WEIGHTS}, smap, args["conv_state"].shape[0],
                  args["rstate"].shape[0], cap.conv_layout_of(args["conv_state"]), cap.tensor_sha256(args["core_out"]),
                  rank, step, dict(meta or {}))
        if dense:
            # no K2 follows on a dense layer; without a worker rank, the driver's call order names it
            with self._lock:
                if rank is None:
                    n = self._counts.get(("dense", layer), 0)
                    self._counts[("dense", layer)] = n + 1
                    world = self.world or 1
                    step = step if step is not None else n // world
                    rank = n % world
                if _want(self.steps, step):
                    self._record(step, layer, rank, self.world or 1, None, None, None, None, rec)
            return res
        with self._lock:
            q = self._pending.setdefault(layer, [])
            q.append(rec)
            del q[:-_MAX_PENDING]
        return res

    def record_k2(self, key, args: dict, launch, *, layer, rank: int, world: int, meta: dict | None = None):
        """Run `launch()` (the real K2 call) with its inputs and outputs recorded."""
        if layer is None or not _want(self.layers, layer):
            return launch()
        with self._lock:
            step, why = self._step_of("k2", layer, rank)
        if why is None and step is not None and not _want(self.steps, step):
            why = "filtered"
        if why is None and self._stopped(rank):
            why = "budget"
        if why is not None:
            if why != "graph" and self._pending.get(layer):
                self._pop_k1(layer, rank, step, cap.tensor_sha256(args["core"]))
            self.skip(why, "a launch outside an eager forward (CUDA-graph capture or replay) is not recorded"
                      if why == "graph" else None, rank)
            return launch()
        core_sha = cap.tensor_sha256(args["core"])
        inp = {n: _clone(args[n]) for n in cap.K2_STATE}
        res = launch()
        after = {n: _clone(args[n]) for n in cap.K2_AFTER}
        k1 = self._pop_k1(layer, rank, step, core_sha)
        if key.reset and k1 is not None:
            # a block-write layer's K2 does not read prefix (DESIGN §5 K2.2; vLLM hands it a fresh
            # buffer): store K1's prefix there, as synth does, so the input is defined
            inp["prefix"] = k1.after["prefix"]
        weights = {n: args.get(n) for n in cap.K2_WEIGHTS}
        with self._lock:
            self._record(step, layer, rank, world, key, inp, after, weights, k1, meta)
        return res

    # ---- internals
    def _stopped(self, rank) -> bool:
        b = self._budgets.get(rank if self.per_rank else None)
        return b is not None and b.stopped

    def _pop_k1(self, layer: int, rank: int, step, core_sha: str) -> _K1 | None:
        """The held K1 of this K2: same layer, its core_out bit-identical to K2's core, and (where
        the K1 knew them) the same rank and step."""
        with self._lock:
            q = self._pending.get(layer, [])
            for i, r in enumerate(q):
                if r.core_sha == core_sha and r.rank in (None, rank) and r.step in (None, step):
                    return q.pop(i)
        return None

    def _warn(self, msg: str) -> None:
        self.warnings.append(msg)
        if not self.quiet:
            print(f"k3verify recorder: {msg}", file=sys.stderr)

    def _root(self, rank: int) -> Path:
        return self.out / f"rank{rank}" if self.per_rank else self.out

    def _event(self, rank: int, event: str, **kw) -> None:
        """One journal line (per_rank only), flushed at once: a killed worker loses nothing written."""
        if not self.per_rank:
            return
        j = self._journals.get(rank)
        if j is None:
            root = self._root(rank)
            root.mkdir(parents=True, exist_ok=True)
            j = self._journals[rank] = open(root / "journal.jsonl", "a", encoding="utf-8")
            start = {"event": "start", "rank": rank, "world": self.world, "budget": self.budget,
                     "config": self.cfg.name if self.cfg else None, "tool": self._tool, "pid": os.getpid(),
                     "layers": sorted(self.layers) if self.layers is not None else None,
                     "steps": sorted(self.steps) if self.steps is not None else None, **self._meta}
            j.write(json.dumps(start, sort_keys=True) + "\n")
        j.write(json.dumps({"event": event, **kw}, sort_keys=True) + "\n")
        j.flush()

    def _account(self, rank: int, step: int, need: int):
        """Budget decision for one capture of `need` bytes: (ok, the budget)."""
        b = self._budgets.setdefault(rank if self.per_rank else None, _Budget())
        if b.stopped:
            return False, b
        if b.step != step:
            if b.step is not None and b.step_bytes:
                b.last_step_bytes = b.step_bytes
            b.step, b.step_bytes, b.files = step, 0, []
            if b.last_step_bytes and b.used + b.last_step_bytes > self.budget:
                b.stopped = True
                self._event(rank, "stopped", step=step, reason=f"budget of {self.budget} bytes: the previous step's "
                                                                f"{b.last_step_bytes} bytes would not fit")
                self._warn(f"budget of {self.budget} bytes reached: recording stopped before step {step}")
                return False, b
        if step in b.dropped:
            return False, b
        if b.used + need <= self.budget:
            return True, b
        b.stopped = True
        if b.files:  # mid-step: the step is dropped whole
            removed = [str(p.relative_to(self._root(rank))) for p in b.files]
            for p in b.files:
                p.unlink(missing_ok=True)
                self.written.remove(p)
                try:
                    p.parent.rmdir()
                except OSError:
                    pass
            b.used -= b.step_bytes
            b.dropped.add(step)
            ranks = sorted({rank} if self.per_rank else {int(p.stem[4:]) for p in b.files})
            for r in ranks:
                self._event(r, "dropped", step=step, removed=removed,
                            reason=f"budget of {self.budget} bytes exceeded mid-step")
            self._warn(f"budget of {self.budget} bytes exceeded mid-step: step {step} dropped whole "
                       f"({len(removed)} capture(s) of it removed); recording stopped")
        else:
            self._event(rank, "stopped", step=step, reason=f"budget of {self.budget} bytes reached")
            self._warn(f"budget of {self.budget} bytes reached: recording stopped before step {step}")
        return False, b

    def _record(self, step, layer, rank, world, key, inp, after, weights, k1: _K1 | None, meta=None) -> None:
        kind = "dense" if key is None else "kda" if k1 is not None else "mla"
        if self.cfg is not None and self.cfg.kind(layer) != kind:
            if self.cfg.kind(layer) == "kda" and kind == "mla":
                reason = "K2 without its K1 (the K1 ran another path, e.g. vLLM's original one)"
                self._count(rank, "k2_without_k1")
                if reason not in self._warned:
                    self._warned.add(reason)
                    self._warn(f"step {step} layer {layer} rank {rank}: {reason}; not recorded")
                return
            self._refuse("k1" if key is None else "k2", layer, rank,
                         f"config {self.cfg.name} says {self.cfg.kind(layer)}, recorded a {kind} launch sequence",
                         step)
            return
        if self.world is not None and world != self.world:
            self._refuse("k2", layer, rank, f"world {world} but the recorder's world is {self.world}", step)
            return
        root = self._root(rank)
        tensors = list((inp or {}).values()) + list((after or {}).values())
        if k1 is not None:
            tensors += list(k1.inp.values()) + list(k1.after.values())
        try:
            named = ([("k2", weights)] if weights is not None else []) + ([("k1", k1.weights)] if k1 is not None else [])
            refs = [(w,) + self.weights.name(root, kernel, layer, rank, w) for kernel, w in named]
        except Refused as e:
            self._refuse("k2", layer, rank, str(e), step)
            return
        est = _nbytes(tensors) + _EST_MANIFEST
        new_w = sum(r[2] for r in refs)
        ok, b = self._account(rank, step, est + new_w)
        if not ok:
            self._count(rank, "budget")
            return
        for _, addr, _, commit in refs:
            commit()
        b.used += new_w
        dev = next(t.device for t in tensors if t is not None)
        if self._producer is None:
            self._producer = cap.producer(self._tool, dev, git=self._git)
        m = {"recorder": {**self._meta, **(meta or {}), **(k1.meta if k1 is not None else {})}}
        rec = cap.StepRecord(step=step, layer=layer, rank=rank, world=world, kind=kind,
                             fmt=key.experts if key is not None else "bf16", k2_key=key, k2_in=inp,
                             k2_weights=refs[0][1] if weights is not None else None, k2_after=after, cfg=self.cfg,
                             dims=None if self.cfg else _dims(inp, weights, k1), meta=m)
        if k1 is not None:
            rec.k1_key, rec.k1_in, rec.k1_after, rec.k1_weights = k1.key, k1.inp, k1.after, refs[-1][1]
            rec.slot_map, rec.conv_slots, rec.rec_slots = k1.slot_map, k1.conv_slots, k1.rec_slots
            rec.conv_layout = k1.conv_layout
        path = cap.write_capture(root, rec, self._producer)
        b.used += est
        b.step_bytes += est
        b.files.append(path)
        self.written.append(path)
        self._event(rank, "written", step=step, layer=layer, kind=kind,
                    file=str(path.relative_to(root)))


def _dims(inp: dict | None, w2: dict | None, k1: _K1 | None) -> dict:
    """Dims read off the tensors when the recorder has no Config (the manifest's config.dims)."""
    d = {}
    if w2 is not None:
        d.update(hidden=inp["prefix"].shape[1], p=inp["core"].shape[1], experts=w2["w_gate"].shape[0],
                 lat=w2["w_ld"].shape[0], ri=w2["w13"].shape[1] // 2, si=w2["w_sd"].shape[1],
                 up_n=w2["w_up"].shape[0], nbmax=inp["blocks"].shape[1])
    if k1 is not None:
        w1 = k1.weights
        d.update(hidden=k1.inp["prefix"].shape[1], nbmax=k1.inp["blocks"].shape[1], nh=w1["a_log"].shape[0],
                 hd=w1["on_w"].shape[0], rank=w1["w_fb"].shape[1], conv=w1["conv_w"].shape[1],
                 nproj=w1["w_in"].shape[0], qkv=w1["conv_w"].shape[0])
    return d
