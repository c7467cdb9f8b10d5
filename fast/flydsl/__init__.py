"""The FlyDSL backend: fused K1/K2 for AMD Instinct gfx942 (MI300) and gfx950 (MI350).

`BACKEND.kda_pre` / `BACKEND.k2_launch` follow docs/backend-contract.md and run on a
ROCm device; `compile_build(key, arch, **dims)` compiles the same launches without
running them (FlyDSL's compile-only mode), on any machine with `ld.lld`.
Kernels, work splits and rounding points: docs/flydsl.md.
"""
from __future__ import annotations

from ref.abi import K1_TAPS, K2_TAPS

from . import toolchain

def compile_build(key, arch: str, debug: bool = False, **dims) -> list[dict]:
    """Compile every launch of one build for `arch` without running it.

    key: KdaPreBuild (dims: S L H NBMAX NP NH HD RK W SL [conv_w]) or K2Build
    (dims: S H NBMAX P E LAT SI RI UP [bias]). One dict per launch: name, kernel, arch,
    vgpr (arch + acc, the unified count), agpr, sgpr, lds, scratch, vgpr_spill, sgpr_spill, code_bytes,
    wavefront, wg_size, waves (per SIMD), waves_limit, seconds.
    """
    from ref.config import KdaPreBuild

    from . import build as B

    if isinstance(key, KdaPreBuild):
        d = B.K1Dims(**dims)
        return B.compile_program(B.k1_program(key, d, debug), B.k1_abi_shapes(key, d), arch)
    d = B.K2Dims(**dims)
    return B.compile_program(B.k2_program(key, d), B.k2_abi_shapes(key, d), arch)


def dims_for(cfg, tokens: int, qlen: int, state_len: int | None = None, conv_w: str = "f32",
             bias: str = "f32") -> tuple[dict, dict]:
    """(K1 dims, K2 dims) of a config preset at S = tokens, L = qlen; conv_w / bias are the
    dtypes ("f32" | "bf16") of those weights (default: what vLLM passes, fp32)."""
    k1 = dict(S=tokens, L=qlen, H=cfg.hidden, NBMAX=cfg.nbmax, NP=cfg.nproj, NH=cfg.nh, HD=cfg.hd, RK=cfg.rank,
              W=cfg.conv, SL=state_len or cfg.conv - 2 + qlen, conv_w=conv_w)
    k2 = dict(S=tokens, H=cfg.hidden, NBMAX=cfg.nbmax, P=cfg.p, E=cfg.experts, LAT=cfg.lat, SI=cfg.si, RI=cfg.ri,
              UP=cfg.up_n, bias=bias)
    return k1, k2


class FlyDSLBackend:
    name = "flydsl"
    TAPS_K1 = K1_TAPS
    TAPS_K2 = K2_TAPS

    @property
    def version(self) -> str:
        return toolchain.flydsl_version() or "not installed"

    def available(self):
        return toolchain.available()

    def _require(self):
        ok, why = toolchain.available()
        if not ok:
            raise RuntimeError(f"flydsl backend: {why}")

    def kda_pre(self, key, *, prefix, delta, blocks, ares_nw, ares_qk, in_nw, w_in, w_fb, conv_w, conv_state,
                a_log, dt_bias, on_w, rstate, st_idx, num_acc, core_out, layer=None, taps=None, **_runtime):
        """K1 of one rank on the device; writes prefix, blocks, conv_state, rstate, core_out in place."""
        from . import build as B
        from .abi_check import k1_dims

        self._require()
        args = dict(prefix=prefix, delta=delta, blocks=blocks, ares_nw=ares_nw, ares_qk=ares_qk, in_nw=in_nw,
                    w_in=w_in, w_fb=w_fb, conv_w=conv_w, conv_state=conv_state, a_log=a_log, dt_bias=dt_bias,
                    on_w=on_w, rstate=rstate, st_idx=st_idx, num_acc=num_acc, core_out=core_out)
        dims = k1_dims(key, args)
        prog = B.k1_program(key, dims, debug=taps is not None)
        bufs = _with_scratch(args, prog)
        _run(prog, bufs, prefix.device)
        if taps is not None:
            taps.update({t: bufs[b].clone() for t, b in prog.taps})

    def k2_launch(self, key, *, core, w_o, prefix, blocks, ares_nw, ares_qk, in_nw, w_gate, bias, w_ld, w_sgu, w_sd,
                  w13, w13s, w2, w2s, ln_w, w_up, out, layer=None, rank=0, comm=None, taps=None, **_runtime):
        """K2 of one rank on the device; its three reductions go through `comm`."""
        from . import build as B
        from .abi_check import k2_dims

        self._require()
        args = dict(core=core, w_o=w_o, prefix=prefix, blocks=blocks, ares_nw=ares_nw, ares_qk=ares_qk, in_nw=in_nw,
                    w_gate=w_gate, bias=bias, w_ld=w_ld, w_sgu=w_sgu, w_sd=w_sd, w13=w13, w13s=w13s, w2=w2, w2s=w2s,
                    ln_w=ln_w, w_up=w_up, out=out)
        dims = k2_dims(key, args, rank, comm)
        prog = B.k2_program(key, dims)
        bufs = _with_scratch(args, prog)
        # bf16 experts take no scales; their launch slot gets the weights (never read)
        bufs["w13s"] = w13s if w13s is not None else w13
        bufs["w2s"] = w2s if w2s is not None else w2
        cols = slice(rank * dims.UP, (rank + 1) * dims.UP)
        _run(prog, bufs, prefix.device, rank=rank, comm=comm, up_cols=cols)
        if taps is not None:
            taps.update({t: bufs[b].clone() for t, b in prog.taps})


def _with_scratch(args: dict, prog) -> dict:
    import torch

    dev = args["prefix"].device
    bufs = dict(args)
    for n, shape, dt in prog.scratch:
        bufs[n] = torch.empty(shape, dtype=dt, device=dev)
    return bufs


def _run(prog, bufs, device, rank=0, comm=None, up_cols=None):
    import torch

    from . import build as B

    toolchain.runtime_env()
    B.run_program(prog, bufs, rank, comm, up_cols, stream=torch.cuda.current_stream(device))


BACKEND = FlyDSLBackend()

__all__ = ["BACKEND", "FlyDSLBackend", "compile_build", "dims_for"]
