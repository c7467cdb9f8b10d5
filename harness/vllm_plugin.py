"""vLLM plugin (entry point group `vllm.general_plugins`, name `k3verify_record`): record
captures from a live vLLM server running the Kimi-K3 mono decode kernels (DESIGN §12).

vLLM calls `register()` in every process it starts; with `K3VERIFY_RECORD` unset it does
nothing. Set, it wraps — in every process that imports them, i.e. every TP worker — the
module attributes vLLM's call sites look up at each call:

    vllm.models.kimi_k3.amd.mono.attention.kda.kda_pre   (K1; older layout mono/kda_pre.py)
    vllm.models.kimi_k3.amd.mono.layer.k2_launch         (K2; older layout mono/k2.py)
    vllm.models.kimi_k3.amd.mono.runner.step_begin       (once a forward: numbers the steps)

A module imported later is wrapped when it is imported (an import hook), so the plugin
imports nothing heavy into processes that never load the kernels. Each wrapper maps the
real ABI to k3verify's (`fast.vllm_mono.abi`), hands the recorder (`harness.recorder`) its
tensors and a thunk that makes the real call with the real arguments, unchanged: the
recorder reads tensors before and after it and never alters what the kernel computes.

Environment (read once, at `register`; a bad value stops vLLM's start with one line):

    K3VERIFY_RECORD=DIR                 record under DIR (rank r writes DIR/rank{r}/)
    K3VERIFY_RECORD_LAYERS=1-3,12       model layers to record (default: all)
    K3VERIFY_RECORD_STEPS=0-63          forwards to record, counted per worker (default: all)
    K3VERIFY_RECORD_BUDGET=4G           bytes per rank (K/M/G/T suffixes, powers of 1024; default 4G)
    K3VERIFY_RECORD_CONFIG=k3-tp8       the k3verify preset the model matches (default k3-tp8)
    K3VERIFY_RECORD_WEIGHTS=stored      how captures name weights (stored: copied once per
                                        layer and rank into DIR/rank{r}/weights)
    K3VERIFY_RECORD_EXPERT_LAYOUT=aiter the layout of the experts K2 receives: aiter (vLLM's
                                        pre-shuffled MXFP4/int4; stored weights refuse it) or logical

Then `k3verify group DIR` assembles the ranks into capture sets (DIR/sets) and says what is
incomplete. See docs/vllm.md.

CUDA graphs: nothing is recorded inside a graph. A launch while the current stream is
capturing is passed straight through (one warning; no copy, no host sync is added to the
graph). A forward whose `step_begin` ran during a capture, and a graph replay's eager
segments (vLLM's breakable graphs run K1 eagerly at replay while K2 is inside the graph),
are not recorded either. Record with eager forwards: `VLLM_USE_BREAKABLE_CUDAGRAPH=1` (the
mono K1 needs it) with `--enforce-eager` (or `cudagraph_mode` NONE), or batch sizes vLLM
did not capture. In eager forwards the recorder copies tensors and syncs the host (the
slot map, hashes): serving slows down while it records.

The rank is the worker's TP rank (`vllm.distributed.get_tensor_model_parallel_rank`, else
torch.distributed's), never the call order; the layer is the launch's `layer` argument
(K1: the model layer index, K2: 128 + it — vLLM's mailbox slots).
"""
from __future__ import annotations

import atexit
import functools
import importlib.abc
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

ENTRY_POINT = "k3verify_record = harness.vllm_plugin:register"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True)
class Settings:
    out: Path
    layers: frozenset | None
    steps: frozenset | None
    budget: int
    config: str
    weights: str
    expert_layout: str

    @staticmethod
    def from_env(env=os.environ) -> "Settings":
        from ref.config import PRESETS

        out = env.get("K3VERIFY_RECORD", "")
        if not out:
            raise InputError("K3VERIFY_RECORD", "empty: the folder to record into")
        cfg = env.get("K3VERIFY_RECORD_CONFIG", "k3-tp8")
        if cfg not in PRESETS:
            raise InputError("K3VERIFY_RECORD_CONFIG", f"{cfg!r} is not a preset ({', '.join(PRESETS)})")
        weights = env.get("K3VERIFY_RECORD_WEIGHTS", "stored")
        if weights != "stored":
            raise InputError("K3VERIFY_RECORD_WEIGHTS", f"{weights!r}: this build names weights as 'stored' only "
                                                        "(checkpoint references come with capture schema v2)")
        layout = env.get("K3VERIFY_RECORD_EXPERT_LAYOUT", "aiter")
        if layout not in ("aiter", "logical"):
            raise InputError("K3VERIFY_RECORD_EXPERT_LAYOUT", f"{layout!r} is neither aiter nor logical")
        return Settings(Path(out), parse_set(env.get("K3VERIFY_RECORD_LAYERS"), "K3VERIFY_RECORD_LAYERS"),
                        parse_set(env.get("K3VERIFY_RECORD_STEPS"), "K3VERIFY_RECORD_STEPS"),
                        parse_bytes(env.get("K3VERIFY_RECORD_BUDGET", "4G"), "K3VERIFY_RECORD_BUDGET"), cfg, weights,
                        layout)


def parse_set(spec: str | None, field: str) -> frozenset | None:
    """'1-3,12' -> {1, 2, 3, 12}; unset, empty or 'all' -> None (everything)."""
    if spec is None or spec.strip() in ("", "all"):
        return None
    out = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise InputError(field, f"{spec!r}: expected comma-separated numbers or ranges a-b")
        a = int(m.group(1))
        out.update(range(a, int(m.group(2) or a) + 1))
    return frozenset(out)


def parse_bytes(spec: str, field: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)i?B?\s*", spec or "", re.I)
    if not m:
        raise InputError(field, f"{spec!r}: expected bytes, e.g. 500M or 4G")
    n = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if n <= 0:
        raise InputError(field, f"{spec!r}: must be positive")
    return n


# --------------------------------------------------------------------------- state

class _State:
    settings: Settings | None = None
    recorder = None
    lock = threading.Lock()
    warned: set = set()
    originals: dict = {}  # (module, attr) -> the function we wrapped
    finder = None
    disabled: str | None = None  # why recording was switched off in this process


def _targets():
    from fast.vllm_mono.abi import K1_LAUNCH, K2_LAUNCH, LAYOUTS, RUNNER

    t = {}
    for k1, k2, _ in LAYOUTS.values():
        t[k1] = (K1_LAUNCH, _wrap_k1)
        t[k2] = (K2_LAUNCH, _wrap_k2)
    t[RUNNER] = ("step_begin", _wrap_step)
    return t


def _warn_once(msg: str) -> None:
    if msg not in _State.warned:
        _State.warned.add(msg)
        print(f"k3verify vllm plugin: {msg}", file=sys.stderr)


def register() -> None:
    """The `vllm.general_plugins` entry point: install the wrappers when K3VERIFY_RECORD is set."""
    if not os.environ.get("K3VERIFY_RECORD"):
        return
    s = Settings.from_env()
    if _State.settings is not None:
        return  # vLLM may load plugins more than once a process
    if s.out.exists() and not s.out.is_dir():
        raise InputError("K3VERIFY_RECORD", "exists and is not a folder", str(s.out))
    old = sorted(p.parent.name for p in s.out.glob("rank*/journal.jsonl"))
    if old:
        raise InputError("K3VERIFY_RECORD", f"already holds a recording ({', '.join(old)}); record into an empty "
                                            "folder, nothing is written over", str(s.out))
    _State.settings = s
    _State.disabled = None
    targets = _targets()
    for name, (attr, wrap) in targets.items():
        mod = sys.modules.get(name)
        if mod is not None:
            _patch(mod, attr, wrap)
    _State.finder = _Finder(targets)
    sys.meta_path.insert(0, _State.finder)
    atexit.register(_close)


def deactivate() -> None:
    """Undo `register` in this process: original functions back, import hook removed, journals closed."""
    _close()
    for (mod, attr), fn in list(_State.originals.items()):
        setattr(mod, attr, fn)
    _State.originals.clear()
    if _State.finder in sys.meta_path:
        sys.meta_path.remove(_State.finder)
    _State.finder = None
    _State.settings = None
    _State.warned = set()


def _close() -> None:
    with _State.lock:
        rec, _State.recorder = _State.recorder, None
    if rec is not None:
        rec.close()


def _patch(mod, attr: str, wrap) -> None:
    fn = getattr(mod, attr, None)
    if fn is None or getattr(fn, "_k3verify", False):
        return
    w = wrap(fn)
    w._k3verify = True
    _State.originals[(mod, attr)] = fn
    setattr(mod, attr, w)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps a target module's function right after the module executes."""

    def __init__(self, targets: dict):
        self.targets = targets

    def find_spec(self, name, path, target=None):
        if name not in self.targets:
            return None
        for f in sys.meta_path:
            if f is self or not hasattr(f, "find_spec"):
                continue
            spec = f.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        attr, wrap = self.targets[name]
        exec_module = loader.exec_module

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                exec_module(module)
                _patch(module, attr, wrap)

        spec.loader = _Loader()
        return spec


# --------------------------------------------------------------------------- wrappers

def worker_rank() -> tuple[int, int]:
    """(TP rank, TP world) of this worker: vLLM's TP group, else torch.distributed's, else (0, 1)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - not vLLM, or no TP group yet
        pass
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def capturing() -> bool:
    """Is the current stream capturing a CUDA graph (host sync or copies now would join the graph)?"""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _recorder():
    with _State.lock:
        if _State.recorder is None and _State.disabled is None:
            from ref.config import get_config

            from .recorder import Recorder, StoredWeights

            s = _State.settings
            cfg = get_config(s.config)
            _State.recorder = Recorder(None, None, s.out, s.budget, layers=s.layers, steps=s.steps, cfg=cfg,
                                       tool="k3verify vllm plugin", per_rank=True, quiet=False,
                                       weights=StoredWeights(s.expert_layout), world=cfg.world,
                                       meta={"expert_layout": s.expert_layout})
        return _State.recorder


def _guard(fn):
    """A recorder failure must never stop serving: it switches recording off in this process, says
    why once, and the launch goes on unrecorded."""

    @functools.wraps(fn)
    def call(orig, *a, **k):
        if _State.settings is None or _State.disabled is not None:
            return orig(*a, **k)
        if capturing():
            _warn_once("a launch during CUDA-graph capture is not recorded (no copy or host sync is added to the "
                       "graph); record with eager forwards")
            return orig(*a, **k)
        done, failed = [], []

        def launch():
            try:
                res = orig(*a, **k)
            except BaseException as e:
                failed.append(e)
                raise
            done.append(res)
            return res

        try:
            return fn(launch, *a, **k)
        except Exception as e:  # noqa: BLE001 - see the docstring
            if failed and e is failed[0]:
                raise  # the launch itself failed: vLLM's error, not the recorder's
            _State.disabled = f"{type(e).__name__}: {e}"
            _warn_once(f"recording switched off in this worker: {_State.disabled}")
            return done[0] if done else orig(*a, **k)

    return call


@_guard
def _record_k1(launch, key, **kw):
    from fast.vllm_mono import abi as vm
    from ref.abi import ArgError

    rec = _recorder()
    rank, world = worker_rank()
    slot = kw.get("layer")
    try:
        layer = vm.model_layer("k1", slot)
    except (ArgError, InputError) as e:
        rec.refuse("k1", slot, rank, str(e))
        return launch()
    if not rec.wants(layer):
        return launch()
    try:
        k3key, extra = vm.k1_key_from_real(key)
        args = vm.k1_from_real(k3key, kw)
    except (ArgError, InputError) as e:
        rec.refuse("k1", layer, rank, str(e))
        return launch()
    return rec.record_k1(k3key, args, launch, layer=layer, rank=rank, meta={"k1_key": extra} if extra else None)


@_guard
def _record_k2(launch, key, **kw):
    from fast.vllm_mono import abi as vm
    from ref.abi import ArgError

    rec = _recorder()
    rank, world = worker_rank()
    slot = kw.get("layer")
    try:
        layer = vm.model_layer("k2", slot)
    except (ArgError, InputError) as e:
        rec.refuse("k2", slot, rank, str(e))
        return launch()
    if not rec.wants(layer):
        return launch()
    try:
        if kw.get("rank") is not None and kw["rank"] != rank:
            raise InputError("k2.rank", f"{kw['rank']} but the worker's TP rank is {rank}")
        cfg = rec.cfg
        _check_kernel_constants(cfg)
        fmt = vm.expert_format(kw["w13"], kw.get("w13s"))
        k3key, extra = vm.k2_key_from_real(key, cfg.topk, cfg.situ_beta, cfg.situ_linear_beta, fmt)
        args = vm.k2_from_real(kw)
    except (ArgError, InputError) as e:
        rec.refuse("k2", layer, rank, str(e))
        return launch()
    return rec.record_k2(k3key, args, launch, layer=layer, rank=rank, world=world,
                         meta={"k2_key": extra} if extra else None)


def _check_kernel_constants(cfg) -> None:
    """The real K2's top-k and SiTU betas are module constants: they must be the config's."""
    from fast.vllm_mono.abi import LAYOUTS

    for _, _, moe_name in LAYOUTS.values():
        moe = sys.modules.get(moe_name)
        if moe is None:
            continue
        for const, want in (("TOPK", cfg.topk), ("BETA", cfg.situ_beta), ("LBETA", cfg.situ_linear_beta)):
            got = getattr(moe, const, None)
            if got is not None and got != want:
                raise InputError(f"{moe_name}.{const}", f"{got} but config {cfg.name} says {want}")


def _wrap_k1(orig):
    @functools.wraps(orig)
    def kda_pre(key, **kw):
        return _record_k1(orig, key, **kw)

    return kda_pre


def _wrap_k2(orig):
    @functools.wraps(orig)
    def k2_launch(key, **kw):
        return _record_k2(orig, key, **kw)

    return k2_launch


def _wrap_step(orig):
    @functools.wraps(orig)
    def step_begin(*a, **k):
        res = orig(*a, **k)
        if _State.settings is not None and _State.disabled is None:
            try:
                rank, _ = worker_rank()
                rec = _recorder()
                if rec is not None:
                    rec.begin_step(rank, eager=not capturing())
            except Exception as e:  # noqa: BLE001 - never stop serving
                _State.disabled = f"{type(e).__name__}: {e}"
                _warn_once(f"recording switched off in this worker: {_State.disabled}")
        return res

    return step_begin


__all__ = ["register", "deactivate", "Settings", "parse_set", "parse_bytes", "worker_rank", "capturing",
           "ENTRY_POINT"]
