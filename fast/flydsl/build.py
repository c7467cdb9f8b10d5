"""One build function per launch: (build key, dims) -> the ordered FlyDSL launches.

`k1_program` / `k2_program` are the single source of what runs: the execution path
(`run_program` on a ROCm device) and the compile-only path (`compile_program`, any
machine) walk the same list of steps. A step is a kernel launch (a spec, its
launcher, and the names of the buffers it takes) or, in K2, a reduction through
the collective (`comm.all_reduce`, rank-order fp32 sum) between launches.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass

import torch

from ref.config import K2Build, KdaPreBuild

from . import kernels as KN

BF16, F32, I32, U8 = torch.bfloat16, torch.float32, torch.int32, torch.uint8
DTYPES = {"f32": F32, "bf16": BF16}  # the weights vLLM may pass in either (conv_w, router bias)


def dtype_name(t: torch.Tensor) -> str:
    return next(n for n, d in DTYPES.items() if d == t.dtype)
_LAUNCH_LOCK = threading.Lock()  # host-side dispatch only (K2 ranks may be threads of one process)


@dataclass(frozen=True)
class K1Dims:
    S: int
    L: int
    H: int
    NBMAX: int
    NP: int
    NH: int
    HD: int
    RK: int
    W: int
    SL: int
    conv_w: str = "f32"  # conv weight dtype: vLLM passes the fp32 conv1d.weight; bf16 also taken

    @property
    def P(self):
        return self.NH * self.HD

    @property
    def R(self):
        return self.S // self.L


@dataclass(frozen=True)
class K2Dims:
    S: int
    H: int
    NBMAX: int
    P: int
    E: int
    LAT: int
    SI: int
    RI: int
    UP: int
    bias: str = "f32"  # router bias dtype (vLLM: fp32 e_score_correction_bias; bf16 also taken)


@dataclass(frozen=True)
class Launch:
    label: str  # short, readable: which stage and which variant
    factory: str  # kernels.<factory>
    spec: object
    args: tuple  # buffer names; "name[cols]" = this rank's up-projection columns of that buffer

    @property
    def fn(self):
        return getattr(KN, self.factory)(self.spec)

    @property
    def kernel(self) -> str:
        return KN.kernel_name(_KIND[self.factory](self.spec), self.spec)


@dataclass(frozen=True)
class Reduce:
    src: str
    dst: str


_KIND = {
    "attnres": lambda s: "attnres",
    "gemv": lambda s: f"gemv_{s.tag}",
    "conv": lambda s: "conv",
    "gate": lambda s: "gate",
    "kda": lambda s: "kda",
    "topk": lambda s: "topk",
    "moe": lambda s: f"moe_{s.stage}_{s.fmt}",
    "act": lambda s: f"act_{s.fmt}",
    "ew": lambda s: f"ew_{s.op}",
}


@dataclass(frozen=True)
class Program:
    steps: tuple
    scratch: tuple  # (name, shape, dtype)
    taps: tuple  # (tap name, buffer name)

    @property
    def launches(self):
        return [s for s in self.steps if isinstance(s, Launch)]


# ------------------------------------------------------------------ K1

@functools.lru_cache(maxsize=None)
def k1_program(key: KdaPreBuild, dims: K1Dims, debug: bool = False) -> Program:
    d = dims
    P, R, L = d.P, d.R, d.L
    ar = KN.AttnResSpec(mode="k1", S=d.S, H=d.H, NB=key.nblocks, delta=key.delta, write_idx=key.write_idx,
                        reset=False, eps=key.eps, out_eps=key.out_eps, threads=KN.attnres_threads(d.H))
    steps = (
        Launch(f"k1.attnres nb={key.nblocks} w={key.write_idx}{' +delta' if key.delta else ''}", "attnres", ar,
               ("prefix", "delta" if key.delta else "prefix", "blocks", "ares_nw", "ares_qk", "in_nw", "x", "x")),
        Launch("k1.in_proj", "gemv", KN.plan_gemv("in_proj", d.S, d.NP, d.H, "bf16"),
               ("x", "w_in", "proj", "proj")),
        Launch(f"k1.conv w={d.conv_w}", "conv", KN.ConvSpec(R, L, 3 * P, d.W, key.state_len, d.conv_w),
               ("proj", "conv_w", "conv_state", "st_idx", "num_acc", "conv_out")),
        Launch("k1.gate", "gate", KN.GateSpec(d.S, d.NH, d.HD, d.RK, 4 * P, 4 * P + d.RK, key.lower_bound),
               ("proj", "w_fb", "a_log", "dt_bias", "gate", "beta")),
        Launch("k1.kda+gated_norm" + (" (taps)" if debug else ""), "kda",
               KN.KdaSpec(R, L, d.NH, d.HD, key.onorm_eps, debug, ksplit=KN.kda_ksplit(d.HD)),
               ("conv_out", "proj", "gate", "beta", "rstate", "st_idx", "num_acc", "on_w", "core_out", "o")),
    )
    scratch = (("x", (d.S, d.H), BF16), ("proj", (d.S, d.NP), BF16), ("conv_out", (d.S, 3 * P), BF16),
               ("gate", (d.S, d.NH, d.HD), F32), ("beta", (d.S, d.NH), F32), ("o", (d.S, d.NH, d.HD), BF16))
    taps = tuple((n, n) for n in ("x", "proj", "conv_out", "gate", "beta") + (("o",) if debug else ()))
    return Program(steps, scratch, taps)


def k1_abi_shapes(key: KdaPreBuild, d: K1Dims, slots: int = 4) -> dict:
    P = d.P
    return dict(prefix=((d.S, d.H), BF16), delta=((d.S, d.H), BF16), blocks=((d.S, d.NBMAX, d.H), BF16),
                ares_nw=((d.H,), BF16), ares_qk=((d.H,), BF16), in_nw=((d.H,), BF16), w_in=((d.NP, d.H), BF16),
                w_fb=((P, d.RK), BF16), conv_w=((3 * P, d.W), DTYPES[d.conv_w]), conv_state=((slots, 3 * P, d.SL), BF16),
                a_log=((d.NH,), F32), dt_bias=((P,), F32), on_w=((d.HD,), BF16),
                rstate=((slots, d.NH, d.HD, d.HD), F32), st_idx=((d.R, d.L), I32), num_acc=((d.R,), I32),
                core_out=((d.S, P), BF16))


# ------------------------------------------------------------------ K2

@functools.lru_cache(maxsize=None)
def k2_program(key: K2Build, dims: K2Dims) -> Program:
    d = dims
    fmt, K = key.experts, key.topk
    b, lam = key.situ_beta, key.situ_linear_beta
    actq = {"mxfp4": "mxq", "a8w4": "mx8q"}.get(fmt)  # the latent quantized per 32 (MXFP4 / MXFP8)
    scales13 = "w13" if fmt == "bf16" else "w13s"
    scales2 = "w2" if fmt == "bf16" else "w2s"
    ar = KN.AttnResSpec(mode="k2", S=d.S, H=d.H, NB=key.nblocks, delta=False, write_idx=-1, reset=key.reset,
                        eps=key.eps, out_eps=key.out_eps, threads=KN.attnres_threads(d.H))
    steps = [
        Launch("k2.o_proj", "gemv", KN.plan_gemv("o_proj", d.S, d.H, d.P, "bf16"), ("core", "w_o", "part", "part")),
        Reduce("part", "dsum"),
        Launch(f"k2.attnres nb={key.nblocks}{' reset' if key.reset else ''}", "attnres", ar,
               ("prefix", "dsum", "blocks", "ares_nw", "ares_qk", "in_nw", "x", "delta")),
        Launch("k2.router", "gemv", KN.plan_gemv("router", d.S, d.E, d.H, "f32"), ("x", "w_gate", "logits", "logits")),
        Launch(f"k2.topk k={K} bias={d.bias}", "topk", KN.TopkSpec(d.S, d.E, K, d.bias), ("logits", "bias", "topk_ids", "topk_w")),
        Launch("k2.lat_down", "gemv", KN.plan_gemv("lat_down", d.S, d.LAT, d.H, "bf16"), ("x", "w_ld", "lat", "lat")),
    ]
    if actq:
        steps.append(Launch(f"k2.lat_{actq}", "ew", KN.EwSpec(actq, d.S, d.LAT), ("lat", "lat", "latq")))
    steps += [
        Launch("k2.shared_gu", "gemv", KN.plan_gemv("sh_gu", d.S, 2 * d.SI, d.H, "bf16"), ("x", "w_sgu", "gu", "gu")),
        Launch("k2.shared_situ", "ew", KN.EwSpec("situ", d.S, d.SI, beta=b, lam=lam), ("gu", "gu", "h")),
        Launch("k2.shared_down", "gemv", KN.plan_gemv("sh_down", d.S, d.H, d.SI, "bf16"), ("h", "w_sd", "sh", "sh")),
        Launch(f"k2.experts_up {fmt}", "moe", KN.MoeSpec("up", fmt, d.S, K, 2 * d.RI, d.LAT),
               ("latq" if actq else "lat", "topk_ids", "topk_w", "w13", scales13, "egu")),
        Launch(f"k2.experts_act {fmt}", "act", KN.ActSpec(fmt, d.S * K, d.RI, b, lam), ("egu", "ev")),
        Launch(f"k2.experts_down {fmt}", "moe", KN.MoeSpec("down", fmt, d.S, K, d.LAT, d.RI),
               ("ev", "topk_ids", "topk_w", "w2", scales2, "y")),
        Reduce("y", "ysum"),
        Launch("k2.latent_norm", "ew", KN.EwSpec("rms", d.S, d.LAT, eps=key.ln_eps), ("ysum", "ln_w", "ln")),
        Launch("k2.fin_init", "ew", KN.EwSpec("copy", d.S, d.H), ("sh", "sh", "fin")),
        Launch("k2.up_proj", "gemv", KN.plan_gemv("up", d.S, d.UP, d.LAT, "add_bf16"),
               ("ln", "w_up", "fin[cols]", "sh[cols]")),
        Reduce("fin", "fsum"),
        Launch("k2.out", "ew", KN.EwSpec("round", d.S, d.H), ("fsum", "fsum", "out")),
    ]
    P_ = d.S * K
    scratch = (("part", (d.S, d.H), BF16), ("delta", (d.S, d.H), BF16), ("x", (d.S, d.H), BF16),
               ("logits", (d.S, d.E), F32), ("topk_ids", (d.S, K), I32), ("topk_w", (d.S, K), F32),
               ("lat", (d.S, d.LAT), BF16), ("latq", (d.S, d.LAT), F32), ("gu", (d.S, 2 * d.SI), BF16),
               ("h", (d.S, d.SI), BF16), ("sh", (d.S, d.H), BF16), ("egu", (P_, 2 * d.RI), F32),
               ("ev", (P_, d.RI), F32), ("y", (d.S, d.LAT), BF16), ("ln", (d.S, d.LAT), BF16),
               ("fin", (d.S, d.H), BF16))
    taps = tuple((n, n) for n in ("delta", "x", "logits", "topk_ids", "topk_w", "lat", "sh", "y", "ln", "fin"))
    return Program(tuple(steps), scratch, taps)


def k2_abi_shapes(key: K2Build, d: K2Dims) -> dict:
    fmt, E = key.experts, d.E
    if fmt == "bf16":
        w13, w2 = ((E, 2 * d.RI, d.LAT), BF16), ((E, d.LAT, d.RI), BF16)
        w13s = w2s = None
    else:
        w13, w2 = ((E, 2 * d.RI, d.LAT // 2), U8), ((E, d.LAT, d.RI // 2), U8)
        sd = U8 if fmt in KN.E2M1_WEIGHTS else BF16
        w13s, w2s = ((E, 2 * d.RI, d.LAT // 32), sd), ((E, d.LAT, d.RI // 32), sd)
    return dict(core=((d.S, d.P), BF16), w_o=((d.H, d.P), BF16), prefix=((d.S, d.H), BF16),
                blocks=((d.S, d.NBMAX, d.H), BF16), ares_nw=((d.H,), BF16), ares_qk=((d.H,), BF16),
                in_nw=((d.H,), BF16), w_gate=((E, d.H), BF16), bias=((E,), DTYPES[d.bias]), w_ld=((d.LAT, d.H), BF16),
                w_sgu=((2 * d.SI, d.H), BF16), w_sd=((d.H, d.SI), BF16), w13=w13, w13s=w13s, w2=w2, w2s=w2s,
                ln_w=((d.LAT,), BF16), w_up=((d.UP, d.LAT), BF16), out=((d.S, d.H), BF16),
                dsum=((d.S, d.H), F32), ysum=((d.S, d.LAT), F32), fsum=((d.S, d.H), F32))


# ------------------------------------------------------------------ walking a program

def _resolve(bufs: dict, name: str, up_cols: slice | None):
    if name.endswith("[cols]"):
        return bufs[name[:-6]][:, up_cols]
    return bufs[name]


def placeholders(shapes: dict, scratch) -> dict:
    """Meta tensors of the right shape, dtype and (contiguous) strides: compile-only
    needs no memory (only dtypes and the unit-stride dim shape the compiled code)."""
    out = {}
    for n, v in shapes.items():
        if v is not None:
            out[n] = torch.empty(v[0], dtype=v[1], device="meta")
    for n, shape, dt in scratch:
        out[n] = torch.empty(shape, dtype=dt, device="meta")
    return out


def compile_program(prog: Program, shapes: dict, arch: str, up_cols=None, on_launch=None,
                    keep_dir: str | None = None) -> list[dict]:
    """Compile every launch of `prog` for `arch` without running it; one row per launch."""
    from .toolchain import compile_measure

    bufs = placeholders(shapes, prog.scratch)
    if up_cols is None and shapes.get("w_up") is not None:
        up_cols = slice(0, shapes["w_up"][0][0])
    rows = []
    for st in prog.launches:
        args = tuple(_resolve(bufs, a, up_cols) for a in st.args)
        res = compile_measure(st.fn, args, st.kernel, arch, keep_dir)
        row = dict(name=st.label, kernel=st.kernel, arch=arch, **dataclasses.asdict(res))
        rows.append(row)
        if on_launch:
            on_launch(row)
    return rows


_COMPILED: dict = {}


def _arg_sig(t):
    """What a compiled specialization depends on besides the spec: dtype, rank and the
    (first) unit-stride dim; sizes and other strides are runtime values."""
    st = t.stride()
    return (t.dtype, t.dim(), st.index(1) if 1 in st else -1)


def run_program(prog: Program, bufs: dict, rank: int = 0, comm=None, up_cols=None, stream=None) -> None:
    """Execute on the device: launches in order, reductions through `comm`.

    The first launch of a specialization compiles it (flyc.compile also runs it); later
    launches call the compiled function directly, without re-tracing the kernel.
    """
    import flydsl.compiler as flyc

    for st in prog.steps:
        if isinstance(st, Reduce):
            bufs[st.dst] = comm.all_reduce(bufs[st.src], rank).to(torch.float32).contiguous()
            continue
        args = tuple(_resolve(bufs, a, up_cols) for a in st.args)
        sig = (st.factory, st.spec, args[0].device, tuple(_arg_sig(a) for a in args))
        with _LAUNCH_LOCK:
            fn = _COMPILED.get(sig)
            if fn is None:
                _COMPILED[sig] = flyc.compile(st.fn, *args, stream)
            else:
                fn(*args, stream)
