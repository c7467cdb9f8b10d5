"""`--backend vllm-mono`: replay captures through vLLM's real Kimi-K3 mono kernels (DESIGN §12).

An adapter, not a kernel: it maps k3verify's keys and arguments to the real ABI
(`fast.vllm_mono.abi`) and calls vLLM's host launchers `kda_pre` / `k2_launch`:

- build keys: k3verify's fields, `debug` on when taps are asked (the kernel then dumps `x`
  and `proj` into `x_dbg` / `proj_dbg`, the only taps it has), `timeline`, `kda0`, `xp`, `diag`
  at their defaults, `reduce` on (the final all-reduce in K2, as DESIGN §5);
- `scratch`: one zeroed buffer a device, sized by the module's own `scratch_bytes` /
  `scratch_layout`, grown (a fresh zeroed buffer) when a build needs more;
- `epoch`: a device int32 counter bumped before every launch (vLLM bumps it once a forward;
  its mailbox tags are `epoch·256 + slot + 1` and nothing is zeroed, so a replayed launch must
  never reuse a tag); every rank makes the same calls, so the ranks' epochs agree;
- `layer`: the mailbox slot, the capture's layer for K1 and 128 + it for K2, as vLLM passes;
- strides: the host launcher reads them off the tensors (conv_state in any layout);
- weights: `conv_w`, `a_log`, `dt_bias` and the router `bias` read as fp32 by the kernels
  (upcast, exact, when a capture holds bf16); the experts shuffled into the layout vLLM's
  loader gives the gfx950 kernel (AITER's a16w4 shuffle of w13 / w2, `shuffle_scale_a16w4`
  of w13's scales, `e8m0_shuffle` of w2's), by the node's own AITER, once a weight set;
- K2 `peers` / `rank`: the TP group's `PeerBuffer` (IPC-mapped peer memory; its handle
  exchange runs over a gloo group). K2 therefore needs every TP rank live, one process a
  GPU, in a torch.distributed world of the kernels' TP size (`ref.comm.DistComm`, e.g.
  `benchmarks/multi_gpu.py --backends vllm-mono`). The simulated world (every rank a thread of
  one process) cannot drive the in-kernel reductions: K2 is refused there, and a replay judges
  K1 alone.

The real kernels are built for one shape (k3-tp8 per rank, S <= 8, K1 with nblocks >= 1, gfx950
MXFP4 experts): a capture of another shape is refused with the dimension named, never run.
Nothing here has run on an AMD GPU or against vLLM: see docs/vllm.md.
"""
from __future__ import annotations

import importlib

import torch

from ref.abi import ArgError
from ref.config import K2Build, KdaPreBuild

from . import abi

TAPS = ("x", "proj")


def _hip_device() -> tuple[bool, str]:
    if torch.version.hip is None:
        kind = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
        return False, f"no ROCm device: this torch ({torch.__version__}) is a {kind} build"
    if not torch.cuda.is_available():
        return False, "no ROCm device visible (torch.cuda.is_available() is False)"
    return True, ""


def _arch(index: int = 0) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "gcnArchName", "")).split(":")[0]


class _Modules:
    """vLLM's mono modules of one layout."""

    def __init__(self, layout: str):
        k1, k2, moe = abi.LAYOUTS[layout]
        self.layout = layout
        self.kda = importlib.import_module(k1)
        self.k2 = importlib.import_module(k2)
        self.moe = importlib.import_module(moe)
        try:
            self.gfx942 = bool(importlib.import_module("vllm.models.kimi_k3.amd.mono.common.plan").GFX942)
        except (ImportError, AttributeError):
            self.gfx942 = False

    @property
    def experts(self) -> str:
        """The expert format the K2 build runs: MXFP4 (a4w4) on gfx950, int4 on gfx942."""
        return getattr(self.moe, "EXPERTS", None) or ("int4" if self.gfx942 else "mxfp4")


def load_modules() -> _Modules:
    """The first importable layout (new `mono/attention/kda.py` + `mono/layer.py`, then the older
    `mono/kda_pre.py` + `mono/k2.py`); ImportError naming why none is."""
    why = []
    for layout in abi.LAYOUTS:
        try:
            return _Modules(layout)
        except ImportError as e:
            why.append(f"{abi.LAYOUTS[layout][0]}: {type(e).__name__}: {e}")
    raise ImportError("vLLM mono modules not importable (" + "; ".join(why) + ")")


def _scratch_need(mod, key) -> int:
    if hasattr(mod, "scratch_bytes"):
        return int(mod.scratch_bytes(key))
    if hasattr(mod, "scratch_layout"):
        return max(o + n for o, n in mod.scratch_layout(key).values())
    raise ArgError("scratch", f"{mod.__name__} has neither scratch_bytes nor scratch_layout")


class _Device:
    """Per-device state of the real launches: scratch, epoch, peer buffer, kernel-layout experts."""

    def __init__(self, device):
        self.device = device
        self.scratch = torch.zeros(0, dtype=torch.uint8, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int32, device=device)
        self.peers = None
        self.experts: dict = {}

    def scratch_for(self, need: int) -> torch.Tensor:
        if self.scratch.numel() < need:
            self.scratch = torch.zeros((need + 255) // 256 * 256, dtype=torch.uint8, device=self.device)
        return self.scratch

    def next_epoch(self) -> torch.Tensor:
        self.epoch.add_(1)
        return self.epoch


def _f32(t):
    """The kernels read these as fp32: a bf16 weight upcast is exact."""
    return t if t is None or t.dtype == torch.float32 else t.float()


class VllmMonoBackend:
    name = "vllm-mono"
    TAPS_K1 = TAPS
    TAPS_K2 = ()

    def __init__(self, expert_layout: str = "aiter"):
        """expert_layout: 'aiter' (vLLM's gfx950 loader layout, made with the node's AITER) or
        'logical' (kernels that read DESIGN §7's layout, e.g. the test stand-in)."""
        if expert_layout not in ("aiter", "logical"):
            raise ValueError(f"expert_layout: {expert_layout!r}")
        self.expert_layout = expert_layout
        self._mods: _Modules | None = None
        self._dev: dict = {}

    @property
    def version(self) -> str:
        try:
            import vllm

            return f"vllm {getattr(vllm, '__version__', '?')}"
        except ImportError:
            return "vllm not installed"

    def available(self) -> tuple[bool, str]:
        ok, why = _hip_device()
        if not ok:
            return False, why
        try:
            mods = self.modules()
        except ImportError as e:
            return False, str(e)
        arch = _arch()
        if arch != "gfx950" and not (arch == "gfx942" and mods.gfx942):
            return False, (f"device is {arch or 'unknown'}; vLLM's mono kernels run on gfx950 "
                           "(gfx942 only in a gfx942 build of them)")
        for kernel, mod, names in (("K1", mods.kda, abi.K1_ABI), ("K2", mods.k2, abi.K2_ABI)):
            got = tuple(getattr(getattr(mod, "ABI", None), "names", ()))
            if got != names:
                return False, (f"vLLM's {kernel} ABI ({mod.__name__}.ABI.names, {len(got)} names) is not the one "
                               f"fast/vllm_mono/abi.py maps ({len(names)} names)")
        return True, f"{arch}, vLLM mono kernels ({mods.layout} layout)"

    def modules(self) -> _Modules:
        if self._mods is None:
            self._mods = load_modules()
        return self._mods

    def _device(self, t: torch.Tensor) -> _Device:
        d = self._dev.get(t.device)
        if d is None:
            d = self._dev[t.device] = _Device(t.device)
        return d

    # ------------------------------------------------------------------ K1
    def kda_pre(self, key: KdaPreBuild, *, layer=None, taps=None, **args):
        m = self.modules()
        kda = m.kda
        S = key.tokens
        if S > abi.MAX_TOKENS:
            raise ArgError("key.tokens", f"{S} rows: vLLM's kernels take at most {abi.MAX_TOKENS}")
        if key.nblocks < 1:
            raise ArgError("key.nblocks", f"{key.nblocks}: vLLM's K1 builds need nblocks >= 1 (layer 0 takes "
                                          "vLLM's original path)")
        _expect("w_in", tuple(args["w_in"].shape), (getattr(kda, "NPROJ", None), getattr(kda, "HIDDEN", None)))
        _expect("rstate", tuple(args["rstate"].shape[1:]), (getattr(kda, "NH", None), getattr(kda, "HD", None),
                                                            getattr(kda, "HD", None)))
        a = dict(args)
        for n in ("conv_w", "a_log", "dt_bias"):
            a[n] = _f32(a[n])
        dev = self._device(args["prefix"])
        real_key = abi.k1_real_key(key, kda.KdaPreBuild, debug=taps is not None)
        scratch = dev.scratch_for(_scratch_need(kda, real_key))
        x_dbg = proj_dbg = None
        if taps is not None:
            x_dbg = torch.empty(S, args["prefix"].shape[1], dtype=torch.bfloat16, device=args["prefix"].device)
            proj_dbg = torch.empty(S, args["w_in"].shape[0], dtype=torch.bfloat16, device=args["prefix"].device)
        kw = abi.k1_to_real(key, a, scratch=scratch, epoch=dev.next_epoch(), layer=int(layer or 0), x_dbg=x_dbg,
                            proj_dbg=proj_dbg)
        kda.kda_pre(real_key, **kw)
        if taps is not None:
            taps.update(x=x_dbg, proj=proj_dbg)

    # ------------------------------------------------------------------ K2
    def k2_launch(self, key: K2Build, *, rank=0, comm=None, layer=None, taps=None, **args):
        from ref.comm import DistComm

        m = self.modules()
        while comm is not None and not isinstance(comm, DistComm) and hasattr(comm, "comm"):
            comm = comm.comm  # a wrapper (benchmarks/multi_gpu.py times its reductions)
        if not isinstance(comm, DistComm):
            raise ArgError("comm", "vllm-mono's K2 reduces in-kernel over IPC-mapped peer buffers: every TP rank must "
                                   "be a live process on its own GPU (torch.distributed; benchmarks/multi_gpu.py "
                                   "--backends vllm-mono); the simulated world of one process cannot drive it")
        tp = getattr(m.moe, "TP", comm.world)
        if comm.world != tp:
            raise ArgError("comm", f"world {comm.world}: vLLM's K2 is built for TP={tp}")
        if key.tokens > abi.MAX_TOKENS:
            raise ArgError("key.tokens", f"{key.tokens} rows: vLLM's kernels take at most {abi.MAX_TOKENS}")
        if key.experts != m.experts:
            raise ArgError("key.experts", f"{key.experts!r}: vLLM's K2 here runs {m.experts!r} experts "
                                          "(gfx950: MXFP4 weights, the latent and intermediate quantized to MXFP4)")
        for field, const in (("topk", "TOPK"), ("situ_beta", "BETA"), ("situ_linear_beta", "LBETA")):
            want = getattr(m.moe, const, None)
            if want is not None and getattr(key, field) != want:
                raise ArgError(f"key.{field}", f"{getattr(key, field)}: vLLM's K2 is built with {const}={want}")
        moe = m.moe
        _expect("w_up", tuple(args["w_up"].shape), (getattr(moe, "UP_N", None), getattr(moe, "LAT", None)))
        _expect("w13", tuple(args["w13"].shape[:2]), (getattr(moe, "E", None),
                                                      None if getattr(moe, "RI", None) is None else 2 * moe.RI))
        dev = self._device(args["core"])
        a = dict(args, bias=_f32(args["bias"]))
        a.update(self._kernel_experts(dev, a))
        real_key = abi.k2_real_key(key, m.k2.K2Build)
        scratch = dev.scratch_for(_scratch_need(m.k2, real_key))
        peers = self._peers(dev, comm, rank)
        kw = abi.k2_to_real(a, scratch=scratch, peers=peers.addresses, rank=rank, epoch=dev.next_epoch(),
                            layer=int(layer or 0))
        m.k2.k2_launch(real_key, **kw)

    def _peers(self, dev: _Device, comm, rank: int):
        """The TP group's PeerBuffer (collective: every rank reaches it at its first K2)."""
        if dev.peers is None:
            import torch.distributed as dist

            pm = importlib.import_module(abi.PEER_MEMORY)
            group = comm.group
            if dist.get_backend(group) != "gloo":  # the handle exchange runs over a CPU group
                group = dist.new_group(ranks=list(range(comm.world)), backend="gloo")
            nbytes = self.modules().k2.peer_bytes(abi.MAX_TOKENS)
            dev.peers = pm.PeerBuffer(nbytes, group, rank, comm.world, dev.device)
            dev.peers.bytes.zero_()
        return dev.peers

    def _kernel_experts(self, dev: _Device, a: dict) -> dict:
        """The experts in the layout the kernel reads (made once a weight set and device)."""
        if self.expert_layout == "logical":
            return {}
        k = tuple(a[n].data_ptr() for n in ("w13", "w13s", "w2", "w2s"))
        if k not in dev.experts:
            try:
                from aiter.ops.shuffle import shuffle_scale_a16w4, shuffle_weight_a16w4
                from aiter.utility.fp4_utils import e8m0_shuffle
            except ImportError as e:
                raise ArgError("w13", f"AITER's a16w4 shuffle is not importable ({e}): the experts cannot be put "
                                      "in the layout vLLM's kernel reads") from None
            E = a["w13"].shape[0]
            # vLLM's gfx950 loader: gate/up separated (no _gui_ interleave), AITER's a16w4 shuffle
            w13 = shuffle_weight_a16w4(a["w13"], 16, False)
            w13s = shuffle_scale_a16w4(a["w13s"].reshape(-1, a["w13s"].shape[-1]), E, False)
            w2 = shuffle_weight_a16w4(a["w2"], 16, False)
            w2s = e8m0_shuffle(a["w2s"].reshape(-1, a["w2s"].shape[-1]))
            dev.experts[k] = {n: t.view(torch.uint8).contiguous() for n, t in
                              (("w13", w13), ("w13s", w13s), ("w2", w2), ("w2s", w2s))}
        return dev.experts[k]


def _expect(name: str, got: tuple, want: tuple) -> None:
    """A capture's dims must be the ones the real kernels are compiled for (None: not declared)."""
    if any(w is not None and g != w for g, w in zip(got, want)):
        raise ArgError(name, f"dims {got}, vLLM's kernels are built for {want}: only captures of that shape "
                             "(k3-tp8 per rank) run on them")


BACKEND = VllmMonoBackend()
__all__ = ["BACKEND", "VllmMonoBackend", "load_modules", "abi"]
