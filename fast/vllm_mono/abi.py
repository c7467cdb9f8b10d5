"""k3verify's launch contract (DESIGN §6) <-> the real vLLM Kimi-K3 "mono" kernels' ABI.

Facts read from vllm-project/vllm (REAL-SYSTEM.md §1.2, §1.3, §1.5):

- K1 ``kda_pre`` (``mono/attention/kda.py``@156b0271; the older layout ``mono/kda_pre.py``
  @e2e886c3 has the same fields): build key ``KdaPreBuild`` = k3verify's fields plus
  ``debug, timeline, kda0, xp``; the host launcher takes tensors (``conv_state`` as a
  [slots, dim, state_len] view with any strides) plus ``scratch, layer, epoch`` and the
  optional ``x_dbg, proj_dbg, tl``, and packs the 30 kernel arguments of ``ABI.names``,
  reading ``blk_sm, blk_sr`` (blocks' token and row strides), ``cs_seq, cs_dim, cs_tok``
  (conv_state's slot, channel and position strides), ``rs_seq`` (rstate's slot stride)
  and ``st_stride`` (st_idx's row stride) off the tensors.
- K2 ``k2_launch`` (``mono/layer.py``@156b0271; older ``mono/k2.py``): ``K2Build`` =
  ``tokens, nblocks, eps, out_eps, ln_eps, reset`` plus ``reduce, diag, timeline, xp``;
  top-k, the SiTU betas and the expert format are constants of the kernel (``stages/moe.py``:
  ``TOPK, BETA, LBETA``; MXFP4 on gfx950, int4 on gfx942). 28 kernel arguments.
- Call sites (``mono_decode.py``@9c6c96d8): K1 gets ``layer=layer.layer_idx``, K2
  ``layer=128 + layer_idx``: ``layer`` is the launch's mailbox slot (tags are
  ``epoch·256 + slot + 1``), so K2's slot is the model layer plus 128.

Which real-only key fields change the math: K1 ``xp`` (1 skips the conv-state store, 2
forces a staged load), K2 ``xp`` (7: route without its selection) and ``reduce`` (False
leaves the final all-reduce to the next layer's K1, which DESIGN §5 does not model).
``debug``/``diag``/``timeline`` add dumps and stamps, ``kda0`` moves the first KDA task's
CTA: they change nothing k3verify compares, so they map to k3verify's keys unchanged.
"""
from __future__ import annotations

import dataclasses

import torch

from ref.abi import ArgError
from ref.config import EXPERT_FORMATS, K2Build, KdaPreBuild

K1_ABI = ("prefix", "delta", "blocks", "blk_sm", "blk_sr", "ares_nw", "ares_qk", "in_nw", "w_in", "w_fb",
          "conv_w", "conv_st", "cs_seq", "cs_dim", "cs_tok", "a_log", "dt_bias", "on_w", "rstate", "rs_seq",
          "st_idx", "st_stride", "num_acc", "core_out", "x_dbg", "proj_dbg", "scratch", "layer", "epoch", "tl")
K2_ABI = ("core", "w_o", "prefix", "blocks", "blk_sm", "blk_sr", "ares_nw", "ares_qk", "in_nw", "w_gate", "bias",
          "w_ld", "w_sgu", "w_sd", "w13", "w13s", "w2", "w2s", "ln_w", "w_up", "out", "scratch", "peers", "rank",
          "epoch", "layer", "diag", "tl")

# the two module layouts of the public code: (K1 module, K2 module, MoE constants module)
LAYOUTS = {
    "attention": ("vllm.models.kimi_k3.amd.mono.attention.kda", "vllm.models.kimi_k3.amd.mono.layer",
                  "vllm.models.kimi_k3.amd.mono.stages.moe"),
    "flat": ("vllm.models.kimi_k3.amd.mono.kda_pre", "vllm.models.kimi_k3.amd.mono.k2",
             "vllm.models.kimi_k3.amd.mono.moe"),
}
RUNNER = "vllm.models.kimi_k3.amd.mono.runner"  # step_begin: once a forward, before its first launch
PEER_MEMORY = "vllm.models.kimi_k3.amd.mono.common.peer_memory"
K1_LAUNCH, K2_LAUNCH = "kda_pre", "k2_launch"
K2_SLOT0 = 128  # vLLM's K2 mailbox slot is 128 + layer_idx
MAX_TOKENS = 8  # the real kernels' row limit (runner.MAX_TOKENS)

_K1_SHARED = tuple(f.name for f in dataclasses.fields(KdaPreBuild))
_K2_SHARED = ("tokens", "nblocks", "eps", "out_eps", "ln_eps", "reset")
_K2_FROM_KERNEL = ("topk", "situ_beta", "situ_linear_beta", "experts")  # constants of the real K2
# real-only fields: value that leaves the math as DESIGN §5 states it, and whether another value changes it
K1_EXTRA = {"debug": (False, False), "timeline": (False, False), "kda0": (0, False), "xp": (0, True)}
K2_EXTRA = {"reduce": (True, True), "diag": (False, False), "timeline": (False, False), "xp": (0, True)}
_WHY = {"xp": "a timing experiment that changes what the kernel computes",
        "reduce": "the final all-reduce is left to the next layer's K1, which k3verify's K2 contract does not model"}


def key_fields(key) -> dict:
    """Field -> value of a build key (a dataclass, as the real ones are)."""
    if dataclasses.is_dataclass(key) and not isinstance(key, type):
        return {f.name: getattr(key, f.name) for f in dataclasses.fields(key)}
    raise ArgError("key", f"{type(key).__name__} is not a dataclass build key")


def _split(kernel: str, real: dict, shared, extra: dict) -> dict:
    """Check the real key's fields: every one known, every math-changing extra at its neutral value.
    Returns the extras (the inert ones are kept as the recording's metadata)."""
    cls = "KdaPreBuild" if kernel == "k1" else "K2Build"
    for name, v in real.items():
        if name not in shared and name not in extra:
            raise ArgError(f"{kernel}_key.{name}", f"unknown {cls} field (= {v!r}): k3verify cannot tell whether "
                                                     "it changes what the kernel computes; update fast/vllm_mono/abi.py")
    missing = [n for n in shared if n not in real]
    if missing:
        raise ArgError(f"{kernel}_key.{missing[0]}", f"{cls} has no field {missing[0]!r}: not the ABI "
                                                       "fast/vllm_mono/abi.py maps")
    for name, (neutral, math) in extra.items():
        if math and name in real and real[name] != neutral:
            raise ArgError(f"{kernel}_key.{name}", f"{real[name]!r}: {_WHY[name]}; only {neutral!r} is recorded")
    return {n: real[n] for n in extra if n in real}


def k1_key_from_real(real) -> tuple[KdaPreBuild, dict]:
    """The real KdaPreBuild -> (k3verify's KdaPreBuild, the real-only fields)."""
    f = key_fields(real)
    extra = _split("k1", f, _K1_SHARED, K1_EXTRA)
    return KdaPreBuild(**{n: f[n] for n in _K1_SHARED}), extra


def k2_key_from_real(real, topk: int, situ_beta: float, situ_linear_beta: float, experts: str) -> tuple[K2Build, dict]:
    """The real K2Build and the kernel's constants -> (k3verify's K2Build, the real-only fields)."""
    f = key_fields(real)
    extra = _split("k2", f, _K2_SHARED, K2_EXTRA)
    if experts not in EXPERT_FORMATS:
        raise ArgError("k2_key.experts", f"{experts!r} not in {', '.join(EXPERT_FORMATS)}")
    return K2Build(**{n: f[n] for n in _K2_SHARED}, topk=int(topk), situ_beta=float(situ_beta),
                   situ_linear_beta=float(situ_linear_beta), experts=experts), extra


def k1_real_key(key: KdaPreBuild, cls, debug: bool = False):
    """k3verify's KdaPreBuild -> the real module's class (`cls`), real-only fields at their defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    _split("k1", {n: None for n in names}, _K1_SHARED, {n: (None, False) for n in K1_EXTRA})
    kw = {n: getattr(key, n) for n in _K1_SHARED}
    if debug:
        kw["debug"] = True
    return cls(**kw)


def k2_real_key(key: K2Build, cls, diag: bool = False):
    """k3verify's K2Build -> the real class; the final reduce in this launch, as DESIGN §5 K2.10."""
    names = {f.name for f in dataclasses.fields(cls)}
    _split("k2", {n: None for n in names}, _K2_SHARED, {n: (None, False) for n in K2_EXTRA})
    kw = {n: getattr(key, n) for n in _K2_SHARED}
    if "reduce" in names:
        kw["reduce"] = True
    if diag:
        kw["diag"] = True
    return cls(**kw)


def expert_format(w13: torch.Tensor, w13s: torch.Tensor | None) -> str:
    """The k3verify expert format of the real K2's weights: uint8 codes with uint8 E8M0 scales are
    the gfx950 a4w4 path (``mxfp4``: the kernel quantizes the latent to MXFP4), bf16 scales the
    gfx942 ``int4`` path, bf16 weights ``bf16``."""
    if w13.dtype == torch.bfloat16 and w13s is None:
        return "bf16"
    if w13.dtype == torch.uint8 and w13s is not None and w13s.dtype == torch.uint8:
        return "mxfp4"
    if w13.dtype == torch.uint8 and w13s is not None and w13s.dtype == torch.bfloat16:
        return "int4"
    raise ArgError("weights.k2.w13", f"w13 {w13.dtype} with scales "
                                       f"{None if w13s is None else w13s.dtype}: no k3verify expert format")


def model_layer(kernel: str, slot: int) -> int:
    """The model layer index of a launch from its `layer` argument (K1: the index; K2: 128 + it)."""
    if kernel == "k1":
        if not 0 <= slot < K2_SLOT0:
            raise ArgError("k1.layer", f"{slot}: vLLM passes K1 the model layer index (0..127)")
        return int(slot)
    if slot < K2_SLOT0:
        raise ArgError("k2.layer", f"{slot}: vLLM passes K2 layer = 128 + layer_idx")
    return int(slot) - K2_SLOT0


def real_slot(kernel: str, layer: int) -> int:
    return layer if kernel == "k1" else K2_SLOT0 + layer


def _dense(shape) -> tuple[int, ...]:
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= n
    return tuple(reversed(st))


def _view(base: torch.Tensor, shape, strides, field: str) -> torch.Tensor:
    """A strided view over `base`'s storage (from its offset), as the kernel addresses it."""
    try:
        return torch.as_strided(base, tuple(shape), tuple(strides), base.storage_offset())
    except RuntimeError as e:
        raise ArgError(field, f"strides {tuple(strides)} for shape {tuple(shape)} leave the buffer ({e})") from None


def k1_from_real(key: KdaPreBuild, kw: dict) -> dict:
    """Real K1 arguments -> k3verify's K1 arguments (same tensors, viewed, never copied).

    Takes the host launcher's keywords (``conv_state`` a tensor) or the kernel's ABI form
    (``conv_st`` with ``cs_seq, cs_dim, cs_tok``; ``rs_seq``; ``blk_sm, blk_sr``; ``st_stride``):
    the ABI form is rebuilt into the [slots, C, SL] conv view and the other strided views."""
    out = {n: kw.get(n) for n in ("prefix", "delta", "blocks", "ares_nw", "ares_qk", "in_nw", "w_in", "w_fb",
                                   "conv_w", "a_log", "dt_bias", "on_w", "rstate", "st_idx", "num_acc", "core_out")}
    for n, t in out.items():
        if t is None and n != "delta":
            raise ArgError(f"k1.{n}", "missing from the launch")
    conv = kw.get("conv_state")
    if conv is None:
        base = kw.get("conv_st")
        if base is None:
            raise ArgError("k1.conv_state", "neither conv_state nor conv_st was passed")
        strides = [kw.get(s) for s in ("cs_seq", "cs_dim", "cs_tok")]
        if any(s is None for s in strides):
            raise ArgError("k1.conv_st", "needs its strides cs_seq, cs_dim, cs_tok")
        conv = _view(base, (base.shape[0], out["conv_w"].shape[0], key.state_len), strides, "k1.conv_st")
    out["conv_state"] = conv
    if kw.get("rs_seq") is not None and kw["rs_seq"] != out["rstate"].stride(0):
        rs = out["rstate"]
        out["rstate"] = _view(rs, rs.shape, (kw["rs_seq"],) + _dense(rs.shape[1:]), "k1.rs_seq")
    if kw.get("st_stride") is not None and kw["st_stride"] != out["st_idx"].stride(0):
        st = out["st_idx"]
        out["st_idx"] = _view(st, st.shape, (kw["st_stride"], 1), "k1.st_stride")
    out["blocks"] = _blocks(out["blocks"], kw, "k1")
    return out


def _blocks(blocks: torch.Tensor, kw: dict, kernel: str) -> torch.Tensor:
    sm, sr = kw.get("blk_sm"), kw.get("blk_sr")
    if sm is None and sr is None:
        return blocks
    return _view(blocks, blocks.shape, (sm if sm is not None else blocks.stride(0),
                                        sr if sr is not None else blocks.stride(1), 1), f"{kernel}.blk_sm")


_K2_TENSORS = ("core", "w_o", "prefix", "blocks", "ares_nw", "ares_qk", "in_nw", "w_gate", "bias", "w_ld", "w_sgu",
               "w_sd", "w13", "w13s", "w2", "w2s", "ln_w", "w_up", "out")


def k2_from_real(kw: dict) -> dict:
    """Real K2 arguments -> k3verify's K2 arguments (without rank/comm)."""
    out = {n: kw.get(n) for n in _K2_TENSORS}
    for n, t in out.items():
        if t is None and n not in ("w13s", "w2s"):
            raise ArgError(f"k2.{n}", "missing from the launch")
    out["blocks"] = _blocks(out["blocks"], kw, "k2")
    return out


def k1_to_real(key: KdaPreBuild, args: dict, *, scratch, epoch, layer: int, x_dbg=None, proj_dbg=None) -> dict:
    """k3verify's K1 arguments -> the real host launcher's keywords."""
    kw = {n: args[n] for n in ("prefix", "delta", "blocks", "ares_nw", "ares_qk", "in_nw", "w_in", "w_fb", "conv_w",
                               "conv_state", "a_log", "dt_bias", "on_w", "rstate", "st_idx", "num_acc", "core_out")}
    kw.update(scratch=scratch, layer=real_slot("k1", layer), epoch=epoch, x_dbg=x_dbg, proj_dbg=proj_dbg, tl=None)
    return kw


def k2_to_real(args: dict, *, scratch, peers, rank: int, epoch, layer: int, diag=None) -> dict:
    """k3verify's K2 arguments -> the real host launcher's keywords."""
    kw = {n: args[n] for n in _K2_TENSORS}
    kw.update(scratch=scratch, peers=peers, rank=rank, epoch=epoch, layer=real_slot("k2", layer), diag=diag, tl=None)
    return kw


def k1_abi(kw: dict) -> dict:
    """The 30 kernel arguments the real host launcher packs from its keywords, in ABI order
    (tensors for pointers, None for an absent optional one, ints for strides and the slot)."""
    conv, blocks, rstate, st = kw["conv_state"], kw["blocks"], kw["rstate"], kw["st_idx"]
    vals = dict(kw, blk_sm=blocks.stride(0), blk_sr=blocks.stride(1), conv_st=conv, cs_seq=conv.stride(0),
                cs_dim=conv.stride(1), cs_tok=conv.stride(2), rs_seq=rstate.stride(0), st_stride=st.stride(0))
    return {n: vals.get(n) for n in K1_ABI}


def k2_abi(kw: dict) -> dict:
    """The 28 kernel arguments of the real K2 host launcher, in ABI order."""
    b = kw["blocks"]
    vals = dict(kw, blk_sm=b.stride(0), blk_sr=b.stride(1))
    return {n: vals.get(n) for n in K2_ABI}


# Where vLLM takes each weight argument from (mono_decode.py@9c6c96d8), relative to the decoder
# layer `model.layers.{i}`: what a checkpoint reference (DESIGN §8, issue I) has to name.
K1_WEIGHT_SOURCES = {
    "ares_nw": "self_attention_res_norm.weight", "ares_qk": "self_attention_res_proj.weight (viewed [hidden])",
    "in_nw": "input_layernorm.weight", "w_in": "self_attn.in_proj_qkvgfab.weight (this rank's rows)",
    "w_fb": "self_attn.f_b_proj.weight (this rank's rows)", "conv_w": "self_attn.conv1d.weight (viewed [QKV, 4])",
    "a_log": "self_attn.A_log", "dt_bias": "self_attn.dt_bias", "on_w": "self_attn.o_norm.weight",
}
K2_WEIGHT_SOURCES = {
    "w_o": "self_attn.o_proj.weight (this rank's columns)", "ares_nw": "mlp_res_norm.weight",
    "ares_qk": "mlp_res_proj.weight (viewed [hidden])", "in_nw": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate.weight", "bias": "mlp.gate.e_score_correction_bias",
    "w_ld": "mlp.routed_expert_down_proj.weight", "w_sgu": "mlp.shared_experts.gate_up_proj.weight",
    "w_sd": "mlp.shared_experts.down_proj.weight", "w13": "mlp.experts.w13_weight (AITER-shuffled)",
    "w13s": "mlp.experts.w13_weight_scale (AITER-shuffled)", "w2": "mlp.experts.w2_weight (AITER-shuffled)",
    "w2s": "mlp.experts.w2_weight_scale (AITER-shuffled)", "ln_w": "mlp.routed_expert_norm.weight",
    "w_up": "mlp.routed_expert_up_proj.weight, rows [rank·UP_N, (rank+1)·UP_N)",
}
