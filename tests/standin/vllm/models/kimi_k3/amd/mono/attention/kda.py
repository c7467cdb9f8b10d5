"""Stand-in of vLLM's K1 `kda_pre` (`mono/attention/kda.py`@156b0271) at the tiny preset:
the same `KdaPreBuild`, `ABI` (30 names), `scratch_layout`, host launcher signature and
asserts; the "kernel" unpacks the arguments by ABI name, rebuilds the strided views from
the pointers' tensors and the stride scalars, and runs `ref.kda_pre`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import ref
from ref.config import KdaPreBuild as _RefKey
from ref.config import get_config
from vllm.models.kimi_k3.amd.mono.common import mailbox
from vllm.models.kimi_k3.amd.mono.common.abi import KernelAbi

_C = get_config("tiny")
HIDDEN = _C.hidden
NA = max(1, HIDDEN // 128)  # attn CTAs (128 hidden columns a slice)
HD = _C.hd
NH = _C.nh
PROJ = NH * HD
QKV = 3 * PROJ
NPROJ = _C.nproj
CONV_W = _C.conv
NVCH = max(1, HD // 16)
TAG_SLOTS = mailbox.TAG_SLOTS


@dataclass(frozen=True)
class KdaPreBuild:
    tokens: int
    qlen: int
    nblocks: int
    delta: bool
    state_len: int
    eps: float = 1e-5
    out_eps: float = 1e-5
    onorm_eps: float = 1e-5
    lower_bound: float = -5.0
    debug: bool = False
    timeline: bool = False
    write_idx: int = -1
    kda0: int = 0
    xp: int = 0


ABI = KernelAbi(("prefix", "delta", "blocks", "blk_sm", "blk_sr", "ares_nw", "ares_qk", "in_nw", "w_in", "w_fb",
                 "conv_w", "conv_st", "cs_seq", "cs_dim", "cs_tok", "a_log", "dt_bias", "on_w", "rstate", "rs_seq",
                 "st_idx", "st_stride", "num_acc", "core_out", "x_dbg", "proj_dbg", "scratch", "layer", "epoch", "tl"))


def scratch_layout(key: KdaPreBuild) -> dict:
    s, ns = key.tokens, key.nblocks + 1
    assert s % key.qlen == 0
    lay = mailbox.pair_layout({"part": NA * s * ns * 2, "wgt": s * (ns + 1), "msq": NA * s, "xrdy": NA,
                               "proj": s * NPROJ, "qk": s * NH * 2 * HD, "onrm": s * NH * NVCH}.items())
    end = max(o + n for o, n in lay.values())
    lay["x"] = ((end + 15) // 16 * 16, s * HIDDEN * 2)
    return lay


def scratch_bytes(key: KdaPreBuild) -> int:
    return max(o + n for o, n in scratch_layout(key).values())


_BUILDS: dict = {}


def build(key: KdaPreBuild):
    """The compiled launcher of one build (the stand-in compiles nothing)."""
    if key in _BUILDS:
        return _BUILDS[key]
    assert key.qlen <= 16 and key.tokens % key.qlen == 0

    def launch(*args, stream=None):
        _kernel(key, ABI.unpack(args))

    _BUILDS[key] = launch
    return launch


def _kernel(key: KdaPreBuild, a: dict) -> None:
    mailbox.claim(a["scratch"], scratch_bytes(key), a["epoch"], a["layer"])
    if key.xp:
        raise NotImplementedError("stand-in: timing experiments (xp) are not modelled")
    for n in ("conv_w", "a_log", "dt_bias"):  # the kernel loads them as f32 (buffer_load T.f32)
        if a[n].dtype != torch.float32:
            raise RuntimeError(f"{n} is {a[n].dtype}: vLLM's K1 reads it as fp32 and would misread it")
    cb = a["conv_st"]
    conv = torch.as_strided(cb, (cb.shape[0], QKV, key.state_len), (a["cs_seq"], a["cs_dim"], a["cs_tok"]),
                            cb.storage_offset())
    rb = a["rstate"]
    rstate = torch.as_strided(rb, (rb.shape[0], NH, HD, HD), (a["rs_seq"], HD * HD, HD, 1), rb.storage_offset())
    bb = a["blocks"]
    blocks = torch.as_strided(bb, bb.shape, (a["blk_sm"], a["blk_sr"], 1), bb.storage_offset())
    sb = a["st_idx"]
    st_idx = torch.as_strided(sb, sb.shape, (a["st_stride"], 1), sb.storage_offset())
    k = _RefKey(tokens=key.tokens, qlen=key.qlen, nblocks=key.nblocks, delta=key.delta, state_len=key.state_len,
                eps=key.eps, out_eps=key.out_eps, onorm_eps=key.onorm_eps, lower_bound=key.lower_bound,
                write_idx=key.write_idx)
    taps = {} if key.debug else None
    ref.kda_pre(k, prefix=a["prefix"], delta=a["delta"], blocks=blocks, ares_nw=a["ares_nw"], ares_qk=a["ares_qk"],
                in_nw=a["in_nw"], w_in=a["w_in"], w_fb=a["w_fb"], conv_w=a["conv_w"], conv_state=conv,
                a_log=a["a_log"], dt_bias=a["dt_bias"], on_w=a["on_w"], rstate=rstate, st_idx=st_idx,
                num_acc=a["num_acc"], core_out=a["core_out"], taps=taps)
    if key.debug:
        if a["x_dbg"] is not None:
            a["x_dbg"].copy_(taps["x"])
        if a["proj_dbg"] is not None:
            a["proj_dbg"].copy_(taps["proj"])


def kda_pre(key: KdaPreBuild, *, prefix, delta, blocks, ares_nw, ares_qk, in_nw, w_in, w_fb, conv_w, conv_state,
            a_log, dt_bias, on_w, rstate, st_idx, num_acc, core_out, scratch, layer, epoch, x_dbg=None,
            proj_dbg=None, tl=None):
    """Host launcher, as vLLM's: `conv_state` [slots, dim, state_len] or a transposed view of
    [slots, state_len, dim] (strides read); `rstate` [slots, NH, HD, HD] fp32 (slots may be
    strided); `layer` this launch's mailbox slot below TAG_SLOTS."""
    assert w_in.shape == (NPROJ, HIDDEN) and w_in.is_contiguous()
    assert rstate.dtype == torch.float32 and rstate[0].numel() == NH * HD * HD
    assert rstate[0].is_contiguous(), "a slot's state must be dense; slots may be strided"
    assert conv_state.dtype == torch.bfloat16
    f = build(key)
    f(*ABI.pack(dict(
        prefix=prefix, delta=delta, blocks=blocks, blk_sm=blocks.stride(0), blk_sr=blocks.stride(1),
        ares_nw=ares_nw, ares_qk=ares_qk, in_nw=in_nw, w_in=w_in, w_fb=w_fb, conv_w=conv_w, conv_st=conv_state,
        cs_seq=conv_state.stride(0), cs_dim=conv_state.stride(1), cs_tok=conv_state.stride(2), a_log=a_log,
        dt_bias=dt_bias, on_w=on_w, rstate=rstate, rs_seq=rstate.stride(0), st_idx=st_idx,
        st_stride=st_idx.stride(0), num_acc=num_acc, core_out=core_out, x_dbg=x_dbg, proj_dbg=proj_dbg,
        scratch=scratch, layer=layer, epoch=epoch, tl=tl)))
