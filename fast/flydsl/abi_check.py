"""Launch-argument validation of the FlyDSL backend: the shared ABI checks of
`ref.abi` plus what these kernels additionally need; returns the build dims."""
from __future__ import annotations

from ref import abi
from ref.abi import ArgError
from ref.config import EXPERT_FORMATS

from .build import K1Dims, K2Dims, dtype_name

MAX_TOKENS = 16  # the GEMVs keep one fp32 accumulator per token row in registers


def _device(args: dict) -> None:
    dev = args["prefix"].device
    for n, t in args.items():
        if t is not None and t.device != dev:
            raise ArgError(n, f"on {t.device}, expected {dev} like prefix")
    if dev.type != "cuda":
        raise ArgError("prefix", f"on {dev}: the FlyDSL backend runs on a ROCm device")


def _unit_stride(args: dict) -> None:
    for n, t in args.items():
        if t is not None and t.dim() > 0 and 1 not in t.stride() and t.numel() > 1:
            raise ArgError(n, f"strides {t.stride()} have no unit-stride dim (FlyDSL needs one)")


VEC_READ_K1 = ("w_in", "w_fb")
VEC_READ_K2 = ("core", "w_o", "w_gate", "w_ld", "w_sgu", "w_sd", "w13", "w2", "w_up")


def _aligned(args: dict, names) -> None:
    """Tensors read with 128-bit loads: 16-byte aligned rows, contiguous last dim."""
    for n in names:
        t = args[n]
        rows = [s * t.element_size() for s in t.stride()[:-1]]
        if t.stride()[-1] != 1 or t.data_ptr() % 16 or any(r % 16 for r in rows):
            raise ArgError(n, f"needs a contiguous last dim and 16-byte aligned rows (strides {t.stride()})")


def k1_dims(key, args: dict) -> K1Dims:
    d = abi.check_args(abi.K1_ARGS, args, "exact")
    S, L = d["S"], key.qlen
    if key.tokens != S:
        raise ArgError("key.tokens", f"{key.tokens} but prefix has {S} rows")
    if not 1 <= S <= MAX_TOKENS:
        raise ArgError("prefix", f"{S} token rows; the FlyDSL kernels take 1..{MAX_TOKENS}")
    if L < 1 or S % L or d["R"] != S // L:
        raise ArgError("key.qlen", f"{L} with {S} tokens and {d['R']} requests")
    if key.delta != (args["delta"] is not None):
        raise ArgError("delta", f"key.delta={key.delta} but delta is {'None' if args['delta'] is None else 'given'}")
    if key.state_len != d["SL"] or d["SL"] < d["W"] - 2 + L:
        raise ArgError("key.state_len", f"{key.state_len}; conv_state has {d['SL']}, needs ≥ W-2+L")
    if not 0 <= key.nblocks <= d["NB"] or not -1 <= key.write_idx < d["NB"]:
        raise ArgError("key.nblocks", f"nblocks {key.nblocks} / write_idx {key.write_idx} outside the bank of {d['NB']}")
    if d["P"] != d["NH"] * d["HD"] or d["C"] != 3 * d["P"] or d["NP"] < 4 * d["P"] + d["RK"] + d["NH"]:
        raise ArgError("w_in", "column blocks inconsistent with NH, HD, RANK")
    abi.check_k1_indices(args["st_idx"], args["num_acc"], L, d["CS"], d["RS"])
    _device(args)
    _unit_stride(args)
    _aligned(args, VEC_READ_K1)
    return K1Dims(S=S, L=L, H=d["H"], NBMAX=d["NB"], NP=d["NP"], NH=d["NH"], HD=d["HD"], RK=d["RK"], W=d["W"],
                  SL=d["SL"], conv_w=dtype_name(args["conv_w"]))


def k2_dims(key, args: dict, rank, comm) -> K2Dims:
    if key.experts not in EXPERT_FORMATS:
        raise ArgError("key.experts", f"{key.experts!r} not in {EXPERT_FORMATS}")
    d = abi.check_args(abi.K2_ARGS, args, "exact", key.experts)
    if key.tokens != d["S"] or not 1 <= d["S"] <= MAX_TOKENS:
        raise ArgError("key.tokens", f"{key.tokens}; prefix has {d['S']} rows (FlyDSL: 1..{MAX_TOKENS})")
    if not 0 <= key.nblocks <= d["NB"]:
        raise ArgError("key.nblocks", f"{key.nblocks} outside 0..{d['NB']}")
    if not 1 <= key.topk <= d["E"]:
        raise ArgError("key.topk", f"{key.topk} outside 1..E={d['E']}")
    if comm is None:
        raise ArgError("comm", "K2 needs a collective")
    if not isinstance(rank, int) or not 0 <= rank < comm.world:
        raise ArgError("rank", f"{rank!r} outside 0..{comm.world - 1}")
    if d["UP"] * comm.world != d["H"]:
        raise ArgError("w_up", f"{d['UP']} rows × world {comm.world} != hidden {d['H']}")
    fmt, lat, ri = key.experts, d["LAT"], d["RI2"] // 2
    abi.expect_multiple("w13", lat, 32)
    abi.expect_multiple("w2", ri, 32)
    want13, want2 = (lat, ri) if fmt == "bf16" else (lat // 2, ri // 2)
    if args["w13"].shape[2] != want13 or args["w2"].shape[2] != want2:
        raise ArgError("w13", f"packed dims {args['w13'].shape[2]}/{args['w2'].shape[2]}, expected "
                              f"{want13}/{want2} for {fmt}")
    if fmt != "bf16":
        for n, k in (("w13s", lat), ("w2s", ri)):
            if args[n].shape[2] != k // 32:
                raise ArgError(n, f"last dim {args[n].shape[2]}, expected {k // 32}")
    _device(args)
    _unit_stride(args)
    _aligned(args, VEC_READ_K2)
    return K2Dims(S=d["S"], H=d["H"], NBMAX=d["NB"], P=d["P"], E=d["E"], LAT=lat, SI=d["SI"], RI=ri, UP=d["UP"],
                  bias=dtype_name(args["bias"]))
