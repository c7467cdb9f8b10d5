"""Stand-in of vLLM's K2 `k2_launch` (`mono/layer.py`@156b0271) at the tiny preset: the same
`K2Build`, `ABI` (28 names), host launcher signature and asserts; the "kernel" reduces
through the collective behind `peers` (rank order, as the real in-kernel reductions) by
running `ref.k2_launch` with the kernel's constants (top-k, SiTU betas, expert format)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import ref
from ref.config import K2Build as _RefKey
from vllm.models.kimi_k3.amd.mono.attention.kda import HIDDEN, PROJ
from vllm.models.kimi_k3.amd.mono.common import mailbox
from vllm.models.kimi_k3.amd.mono.common.abi import KernelAbi
from vllm.models.kimi_k3.amd.mono.common.peer_memory import group_of
from vllm.models.kimi_k3.amd.mono.stages import moe as k2b


@dataclass(frozen=True)
class K2Build:
    tokens: int
    nblocks: int
    eps: float = 1e-5
    out_eps: float = 1e-5
    ln_eps: float = 1e-5
    reduce: bool = True
    reset: bool = False
    diag: bool = False
    timeline: bool = False
    xp: int = 0


ABI = KernelAbi(("core", "w_o", "prefix", "blocks", "blk_sm", "blk_sr", "ares_nw", "ares_qk", "in_nw", "w_gate",
                 "bias", "w_ld", "w_sgu", "w_sd", "w13", "w13s", "w2", "w2s", "ln_w", "w_up", "out", "scratch",
                 "peers", "rank", "epoch", "layer", "diag", "tl"))


def peer_bytes(s: int) -> int:
    lay = mailbox.pair_layout({"ar": k2b.TP * s * HIDDEN // 2, "rlog": k2b.TP * s * (k2b.E // k2b.TP),
                               "lat": s * k2b.LAT // 2, "latr": k2b.TP * s * k2b.LAT // 2,
                               "final": k2b.TP * s * HIDDEN // 2}.items())
    return 2 * max(o + n for o, n in lay.values())


def scratch_layout(key: K2Build) -> dict:
    s, ns = key.tokens, key.nblocks + 1
    lay = mailbox.pair_layout({"part": s * ns * 2, "wgt": s * (ns + 1), "msq": s, "xrdy": 1,
                               "sgu": s * k2b.SI, "route": s * 2 * k2b.TOPK, "lmsq": s}.items())
    end = max(o + n for o, n in lay.values())
    lay["xrow"] = ((end + 15) // 16 * 16, s * HIDDEN * 2)
    return lay


def scratch_bytes(key: K2Build) -> int:
    return max(o + n for o, n in scratch_layout(key).values())


_BUILDS: dict = {}


def build(key: K2Build):
    if key in _BUILDS:
        return _BUILDS[key]
    assert 1 <= key.tokens <= 8

    def launch(*args, stream=None):
        _kernel(key, ABI.unpack(args))

    _BUILDS[key] = launch
    return launch


def _format(w13, w13s) -> str:
    want = {"mxfp4": (torch.uint8, torch.uint8), "int4": (torch.uint8, torch.bfloat16),
            "bf16": (torch.bfloat16, None)}[k2b.EXPERTS]
    got = (w13.dtype, None if w13s is None else w13s.dtype)
    if got != want:
        raise RuntimeError(f"stand-in K2 runs {k2b.EXPERTS} experts; got w13/w13s {got}")
    return k2b.EXPERTS


def _kernel(key: K2Build, a: dict) -> None:
    mailbox.claim(a["scratch"], scratch_bytes(key), a["epoch"], a["layer"])
    if not key.reduce or key.xp:
        raise NotImplementedError("stand-in: reduce=False and timing experiments (xp) are not modelled")
    if a["bias"].dtype != torch.float32:  # the router reads the correction bias as f32
        raise RuntimeError(f"bias is {a['bias'].dtype}: vLLM's K2 reads it as fp32 and would misread it")
    comm = group_of(a["peers"])
    bb = a["blocks"]
    blocks = torch.as_strided(bb, bb.shape, (a["blk_sm"], a["blk_sr"], 1), bb.storage_offset())
    k = _RefKey(tokens=key.tokens, nblocks=key.nblocks, eps=key.eps, out_eps=key.out_eps, ln_eps=key.ln_eps,
                reset=key.reset, topk=k2b.TOPK, situ_beta=k2b.BETA, situ_linear_beta=k2b.LBETA,
                experts=_format(a["w13"], a["w13s"]))
    ref.k2_launch(k, core=a["core"], w_o=a["w_o"], prefix=a["prefix"], blocks=blocks, ares_nw=a["ares_nw"],
                  ares_qk=a["ares_qk"], in_nw=a["in_nw"], w_gate=a["w_gate"], bias=a["bias"], w_ld=a["w_ld"],
                  w_sgu=a["w_sgu"], w_sd=a["w_sd"], w13=a["w13"], w13s=a["w13s"], w2=a["w2"], w2s=a["w2s"],
                  ln_w=a["ln_w"], w_up=a["w_up"], out=a["out"], rank=a["rank"], comm=comm)


def k2_launch(key: K2Build, *, core, w_o, prefix, blocks, ares_nw, ares_qk, in_nw, w_gate, bias, w_ld, w_sgu, w_sd,
              w13, w13s, w2, w2s, ln_w, w_up, out, scratch, peers, rank, epoch, layer, diag=None, tl=None):
    """Host launcher, as vLLM's: `core` [S, PROJ] (o_proj's input), `prefix` updated in place,
    `out` the MoE output [S, HIDDEN]."""
    assert w_o.shape == (HIDDEN, PROJ) and core.is_contiguous() and prefix.is_contiguous()
    assert w_up.shape == (k2b.UP_N, k2b.LAT) and w_up.is_contiguous()
    f = build(key)
    f(*ABI.pack(dict(
        core=core, w_o=w_o, prefix=prefix, blocks=blocks, blk_sm=blocks.stride(0), blk_sr=blocks.stride(1),
        ares_nw=ares_nw, ares_qk=ares_qk, in_nw=in_nw, w_gate=w_gate, bias=bias, w_ld=w_ld, w_sgu=w_sgu, w_sd=w_sd,
        w13=w13, w13s=w13s, w2=w2, w2s=w2s, ln_w=ln_w, w_up=w_up, out=out, scratch=scratch, peers=peers, rank=rank,
        epoch=epoch, layer=layer, diag=diag, tl=tl)))
