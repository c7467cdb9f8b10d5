"""Host side of the Triton backend: argument checks (shapes/dtypes/strides only: no data
reads, so a step stays capturable in a CUDA graph), per-build scratch, the launches.

Scratch (intermediates and the counters of the in-kernel handshakes) is allocated on the
first call of a (build key, device, dims, rank) and reused: call once before capturing a
graph. Counters return to zero at the end of every launch that uses them.
"""
from __future__ import annotations

import threading

import torch

from ref import abi
from ref.config import K2Build, KdaPreBuild

from . import _jit, _k1, _k2
from .tuning import check_combination, settings

_SCRATCH: dict = {}
_LOCK = threading.Lock()  # one enqueue at a time (the interpreter is not thread-safe)
FMT_CODE = {"bf16": 0, "mxfp4": 1, "int4": 2, "a8w4": 3}  # a8w4: mxfp4 weights, MXFP8 (E4M3) activations
MX_ACT = ("mxfp4", "a8w4")  # activations quantized per 32 with an E8M0 scale (values kept as fp16)


def _p2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _bk(k: int, want: int) -> int:
    """Largest power of two <= want that divides k (a K loop without tail masks)."""
    b = want
    while b > 16 and k % b:
        b //= 2
    if k % b:
        raise abi.ArgError("K", f"dim {k} is not a multiple of 16")
    return b


def _split(nblocks: int, want: int) -> int:
    """Largest K split <= min(want, 16) that divides the number of K blocks."""
    sp = max(1, min(want, 16, nblocks))
    while nblocks % sp:
        sp -= 1
    return sp


def _contig_rows(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise abi.ArgError(name, f"last dim must be contiguous (strides {tuple(t.stride())})")


def _scratch(tag, key, dev, dims, rank, make):
    k = (tag, key, str(dev), dims, rank)
    s = _SCRATCH.get(k)
    if s is None:
        s = _SCRATCH[k] = make()
    return s


def clear_scratch() -> None:
    _SCRATCH.clear()


def _pdl(dev, T) -> dict:
    """Options of a programmatic dependent launch (_jit.pdl_enter): NVIDIA only, TUNE pdl."""
    on = T["pdl"] and dev.type == "cuda" and torch.version.hip is None and _jit.HAS_GDC
    return dict(PDL=int(T["pdl"]), launch_pdl=True) if on else {}


def _nap(dev, T) -> dict:
    """The ticket waits' sleep between polls (_jit.wait_ge NAP): NVIDIA only, TUNE poll_nap."""
    on = T["poll_nap"] > 0 and dev.type == "cuda" and torch.version.hip is None
    return dict(NAP=int(T["poll_nap"])) if on else {}


def _occ(dev, occ: int, warps: int) -> dict:
    """ptxas register cap that leaves room for `occ` programs of `warps` warps per SM (NVIDIA; 0: none).
    An SM's 64K registers go out in 256-register warp units, so the cap is a multiple of 8."""
    if occ <= 0 or dev.type != "cuda" or torch.version.hip is not None:
        return {}
    return dict(maxnreg=min(255, 65536 // (occ * warps * 32) // 8 * 8))


def _launch(kernel, grid, *args, **kw):
    with _LOCK:
        kernel[grid](*args, **kw)


# ------------------------------------------------------------------------------------ K1

def kda_pre(key: KdaPreBuild, *, prefix, delta, blocks, ares_nw, ares_qk, in_nw, w_in, w_fb, conv_w, conv_state,
            a_log, dt_bias, on_w, rstate, st_idx, num_acc, core_out, layer=None, taps=None, **_runtime) -> None:
    """K1 of one rank (DESIGN §5 K1) in 2 launches."""
    args = dict(prefix=prefix, delta=delta, blocks=blocks, ares_nw=ares_nw, ares_qk=ares_qk, in_nw=in_nw,
                w_in=w_in, w_fb=w_fb, conv_w=conv_w, conv_state=conv_state, a_log=a_log, dt_bias=dt_bias,
                on_w=on_w, rstate=rstate, st_idx=st_idx, num_acc=num_acc, core_out=core_out)
    d = abi.check_args(abi.K1_ARGS, args, "exact", check_finite=False)
    S, H, L = d["S"], d["H"], key.qlen
    NH, HD, RANK, W, NP = d["NH"], d["HD"], d["RK"], d["W"], d["NP"]
    P = NH * HD
    if key.tokens != S or L < 1 or S % L or d["R"] != S // L:
        raise abi.ArgError("key.tokens", f"tokens={key.tokens}, qlen={L} do not match prefix rows {S} / "
                                         f"st_idx rows {d['R']}")
    if key.delta != (delta is not None):
        raise abi.ArgError("delta", f"key.delta={key.delta} but delta is {'None' if delta is None else 'given'}")
    if key.state_len != d["SL"] or d["SL"] < W - 2 + L:
        raise abi.ArgError("conv_state", f"state_len {d['SL']} (key {key.state_len}) must be >= W-2+L = {W - 2 + L}")
    if not 0 <= key.nblocks <= d["NB"] or not -1 <= key.write_idx < d["NB"]:
        raise abi.ArgError("key.nblocks", f"nblocks={key.nblocks}, write_idx={key.write_idx} outside the bank")
    if d["C"] != 3 * P or d["P"] != P or NP < 4 * P + RANK + NH:
        raise abi.ArgError("w_in", f"NPROJ={NP}, P={d['P']}, C={d['C']} inconsistent with NH={NH}, HD={HD}")
    if HD & (HD - 1) or RANK & (RANK - 1):
        raise abi.ArgError("on_w", f"head dim {HD} and f_a rank {RANK} must be powers of two")
    for n in ("prefix", "blocks", "w_in", "w_fb", "conv_w", "core_out") + (("delta",) if delta is not None else ()):
        _contig_rows(n, args[n])
    for n in ("ares_nw", "ares_qk", "in_nw", "a_log", "dt_bias", "on_w", "num_acc"):
        if not args[n].is_contiguous():
            raise abi.ArgError(n, "must be contiguous")
    dev = prefix.device
    R = S // L
    T = settings(S)
    NV = max(1, min(T["k1_nv"], HD // 8))  # value-row programs per head (HD is a power of two)
    while NV > 1 and R * NH * NV > T["rec_cap"]:
        NV //= 2
    BV = HD // NV
    bk = _bk(H, T["k1_bk"])
    bn = T["k1_bn"]
    ar = _ares_dims(H, key.nblocks, T["k1_hc"])
    SP = max(16, _p2(S))  # token rows of the K-split partials' planes
    sc = _scratch("k1", key, dev, (S, H, NP, NH, HD, ar["CHP"]), 0, lambda: dict(
        x=torch.empty(S, H, dtype=torch.bfloat16, device=dev),
        proj=torch.empty(S, NP, dtype=torch.bfloat16, device=dev),
        obuf=torch.empty(S, NH, HD, dtype=torch.bfloat16, device=dev),
        ctr=torch.zeros(8 + 2 * S, dtype=torch.int32, device=dev),
        ctr_rec=torch.zeros(R * NH, dtype=torch.int32, device=dev),
        ctr_cnt=torch.zeros(32, dtype=torch.int32, device=dev),  # rec_cnt's count, a 128-byte line of its own
        **_ares_scratch(S, H, key.nblocks, T["k1_hc"], dev),
        part=torch.empty(16, SP, NP, dtype=torch.float32, device=dev),  # K-split partials
        ctr_n=torch.zeros(triton_cdiv(NP, 16), dtype=torch.int32, device=dev)))
    add = 1 if delta is not None else 0
    dptr = delta if delta is not None else prefix
    NB = key.nblocks
    spl = _split(H // bk, T["k1_split"])
    xc = bool(T["k1_xc"])
    grid_mid = (2 if xc else 3) * S * ar["CH"] + triton_cdiv(NP, bn) * spl
    nvidia = dev.type == "cuda" and torch.version.hip is None and _jit.HAS_GDC
    pre = bool(T["rec_pdl"]) and nvidia
    cnt = int(T["rec_cnt"])
    ps = spl if T["k1_part"] and spl > 1 else 0  # partials summed by the recurrence (k1_mid PART)
    rst = bool(T["k1_rst"])
    check_combination(T)
    stamps = {}
    if T["stamps"] and nvidia:  # timeline build: %globaltimer per program (benchmarks/bench_fast.py --timeline)
        for n, size in (("tl_mid", grid_mid * 4), ("tl_rec", R * NH * NV * 4)):
            if n not in sc or sc[n].numel() != size:
                sc[n] = torch.zeros(size, dtype=torch.int64, device=dev)
        stamps = dict(mid=dict(tl_ptr=sc["tl_mid"], TL=True), rec=dict(tl_ptr=sc["tl_rec"], TL=True))
    _launch(_k1.k1_mid_kernel, (grid_mid,), sc["ctr"], prefix, prefix.stride(0),
            dptr, dptr.stride(0), blocks, blocks.stride(0), blocks.stride(1), ares_nw, ares_qk, in_nw, sc["x"],
            sc["apart"], sc["mix"], sc["msq"], w_in, w_in.stride(0), sc["proj"], sc["part"], sc["ctr_n"], S, H,
            ar["HC"], ar["CH"], NP, key.eps, key.out_eps, T["spin"], NB=NB, NBP=ar["NBP"], CHP=ar["CHP"],
            BHC=ar["BHC"], ADD=add, WRITE_IDX=key.write_idx, BN=bn, BK=bk, SP=SP, SPLIT=spl,
            STAG=T["stag"], SWAP=T["k1_swap"], TP=_p2(S), num_warps=T["k1_warps"], num_stages=T["k1_stages"],
            TRIG=pre, XC=xc, LD=T["poll_ld"], **_nap(dev, T), cnt_ptr=sc["ctr_cnt"], CNT=cnt > 0,
            PART=ps > 0, RST=rst, **stamps.get("mid", {}), **_pdl(dev, T))
    tp = taps is not None
    if tp:
        tconv = torch.zeros(S, 3 * P, dtype=torch.bfloat16, device=dev)
        tgate = torch.zeros(S, NH, HD, dtype=torch.float32, device=dev)
        tbeta = torch.zeros(S, NH, dtype=torch.float32, device=dev)
    else:
        tconv = tgate = tbeta = sc["obuf"]
    cs = conv_state
    rsd = rstate
    src = sc["part"] if ps else sc["proj"]
    try:
        _launch(_k1.k1_rec_kernel, (R, NH, NV), src, NP, conv_w, conv_w.stride(0), cs, cs.stride(0), cs.stride(1),
                cs.stride(2), w_fb, w_fb.stride(0), a_log, dt_bias, on_w, rsd, rsd.stride(0), rsd.stride(1),
                rsd.stride(2), rsd.stride(3), st_idx, st_idx.stride(0), st_idx.stride(1), num_acc, core_out,
                core_out.stride(0), sc["obuf"], sc["ctr_rec"], tconv, tgate, tbeta, key.lower_bound, key.onorm_eps,
                L=L, W=W, NH=NH, HD=HD, RANK=RANK, BV=BV, NV=NV, SEQP=_p2(W - 2 + L), LP=max(16, _p2(L)), TAPS=tp,
                GT=T["rec_gt"], FLAT=T["rec_flat"], PRE=pre, LEAN=T["rec_lean"], HOIST=T["rec_hoist"] and L > 1,
                CT=T["rec_ct"], num_warps=T["rec_warps"], enable_fp_fusion=False, cnt_ptr=sc["ctr_cnt"],
                nblk=triton_cdiv(NP, bn), spin=T["spin"], CNT=cnt > 0, LD=cnt == 2 or T["poll_ld"], **_nap(dev, T),
                **_occ(dev, T["rec_occ"], T["rec_warps"]), ppl=SP * NP, PS=ps, mctr_ptr=sc["ctr"], S=S, TPM=_p2(S),
                RST=rst, **stamps.get("rec", {}),
                **dict(_pdl(dev, T), **(dict(launch_pdl=True) if pre else {})))  # fp32 conv_w: w·seq rounds, then adds (as ref/conv.py)
    except BaseException:
        if rst:  # k1_mid's counters wait for this launch's reset
            sc["ctr"].zero_()
        raise
    if tp and ps:  # the in_proj tap: the partials summed as the recurrence sums them
        _launch(_k1.k1_proj_kernel, (triton_cdiv(NP, 64),), sc["part"], SP * NP, sc["proj"], S, NP, PS=ps, SP=SP, BN=64)
    if tp:
        taps.update(x=sc["x"].clone(), proj=sc["proj"].clone(), conv_out=tconv, gate=tgate, beta=tbeta,
                    o=sc["obuf"].clone())


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ares_dims(H: int, NB: int, want: int) -> dict:
    """AttnRes chunking: CH column chunks of width HC (<= want) per token row."""
    HC = min(_p2(H), want)
    CH = triton_cdiv(H, HC)
    HC = triton_cdiv(H, CH)
    return dict(HC=HC, CH=CH, CHP=_p2(CH), BHC=_p2(HC), NBP=_p2(NB + 1))


def _ares_scratch(S: int, H: int, NB: int, want: int, dev) -> dict:
    d = _ares_dims(H, NB, want)
    return dict(apart=torch.empty(S, d["CHP"], 2 * d["NBP"], dtype=torch.float32, device=dev),
                mix=torch.empty(S, H, dtype=torch.float32, device=dev),
                msq=torch.empty(S, d["CHP"], dtype=torch.float32, device=dev))


# ------------------------------------------------------------------------------------ K2

def k2_launch(key: K2Build, *, core, w_o, prefix, blocks, ares_nw, ares_qk, in_nw, w_gate, bias, w_ld, w_sgu, w_sd,
              w13, w13s, w2, w2s, ln_w, w_up, out, layer=None, rank=0, comm=None, taps=None, **_runtime) -> None:
    """K2 of one rank (DESIGN §5 K2): 5 launches and the 3 reductions through `comm`."""
    fmt = key.experts
    if fmt not in FMT_CODE:
        raise abi.ArgError("key.experts", f"{fmt!r} not in {tuple(FMT_CODE)}")
    args = dict(core=core, w_o=w_o, prefix=prefix, blocks=blocks, ares_nw=ares_nw, ares_qk=ares_qk, in_nw=in_nw,
                w_gate=w_gate, bias=bias, w_ld=w_ld, w_sgu=w_sgu, w_sd=w_sd, w13=w13, w13s=w13s, w2=w2, w2s=w2s,
                ln_w=ln_w, w_up=w_up, out=out)
    d = abi.check_args(abi.K2_ARGS, args, "exact", fmt, check_finite=False)
    S, H, P, E, LAT = d["S"], d["H"], d["P"], d["E"], d["LAT"]
    SI, RI, UPN, K = d["SI"], d["RI2"] // 2, d["UP"], key.topk
    if comm is None:
        raise abi.ArgError("comm", "K2 needs a collective (ref.comm.SimWorld / DistComm)")
    world = comm.world
    if key.tokens != S:
        raise abi.ArgError("key.tokens", f"{key.tokens} but prefix has {S} rows")
    if not 0 <= key.nblocks <= d["NB"] or not 1 <= K <= E:
        raise abi.ArgError("key.topk", f"topk={K} (E={E}), nblocks={key.nblocks} out of range")
    if not isinstance(rank, int) or not 0 <= rank < world or UPN * world != H:
        raise abi.ArgError("rank", f"rank={rank!r}, world={world}, w_up rows {UPN}: need UP_N·world = hidden {H}")
    if d["SI2"] != 2 * SI or LAT % 32 or RI % 32 or SI % 16:
        raise abi.ArgError("w13", f"LAT={LAT}, RI={RI} must be multiples of 32, w_sgu rows {d['SI2']} = 2·{SI}")
    packed = fmt != "bf16"
    want13, want2 = (LAT // 2, RI // 2) if packed else (LAT, RI)
    if w13.shape[2] != want13 or w2.shape[2] != want2:
        raise abi.ArgError("w13", f"last dims {w13.shape[2]}, {w2.shape[2]}, expected {want13}, {want2} for {fmt}")
    if packed and (w13s.shape[2] != LAT // 32 or w2s.shape[2] != RI // 32):
        raise abi.ArgError("w13s", f"scale dims {w13s.shape[2]}, {w2s.shape[2]}, expected {LAT // 32}, {RI // 32}")
    for n in ("core", "w_o", "prefix", "blocks", "w_gate", "w_ld", "w_sgu", "w_sd", "w13", "w2", "w_up", "out") + \
            (("w13s", "w2s") if packed else ()):
        _contig_rows(n, args[n])
    for n in ("ares_nw", "ares_qk", "in_nw", "bias", "ln_w"):
        if not args[n].is_contiguous():
            raise abi.ArgError(n, "must be contiguous")
    if out.stride(0) != H or prefix.stride(0) != H:
        raise abi.ArgError("out", "rows of out and prefix must be contiguous [S, H]")
    dev = prefix.device
    T = settings(S)
    SP = max(16, _p2(S))
    DMAX = min(E, S * K)
    BR = min(T["x1_br"], RI)
    while RI % BR:
        BR //= 2
    BR = max(BR, 32)
    BL = min(T["x2_bl"], _p2(LAT))
    while LAT % BL:
        BL //= 2
    NCH, NLB = RI // BR, LAT // BL
    BNL = min(T["mid_bnl"], LAT)
    while LAT % BNL:
        BNL //= 2
    if packed and BNL < 32:
        BNL = 32  # whole quant blocks per program
    NB = key.nblocks
    ar = _ares_dims(H, NB, T["mid_hc"])
    bnm, BNS = T["mid_bn"], T["mid_bns"]
    NG, NL, NS = triton_cdiv(E, bnm), LAT // BNL, triton_cdiv(SI, BNS)
    KL = min(K, bnm)  # router candidates per block and row
    UNR1 = _unr(LAT, T["x1_unr"])
    X1S = _split(LAT // (32 * UNR1), T["x1_split"]) if DMAX * NCH < T["x1_fill"] else 1
    sc = _scratch("k2", key, dev, (S, H, P, E, LAT, SI, RI, UPN, ar["CHP"], NG, X1S), rank, lambda: dict(
        part=torch.empty(S, H, dtype=torch.bfloat16, device=dev),
        x=torch.empty(S, H, dtype=torch.bfloat16, device=dev),
        tapd=torch.empty(S, H, dtype=torch.bfloat16, device=dev),
        **_ares_scratch(S, H, NB, T["mid_hc"], dev),
        logits=torch.empty(S, E, dtype=torch.float32, device=dev),
        cand=torch.empty(S, NG * KL, dtype=torch.int64, device=dev),
        csig=torch.empty(S, NG * KL, dtype=torch.float32, device=dev),
        lat=torch.empty(S, LAT, dtype=torch.bfloat16, device=dev),
        latq=torch.empty(S, LAT, dtype=torch.float16 if fmt in MX_ACT else torch.bfloat16, device=dev),
        lats=torch.empty(S, LAT // 32, dtype=torch.int32, device=dev),
        h=torch.empty(S, SI, dtype=torch.bfloat16, device=dev),
        ids=torch.empty(S, K, dtype=torch.int32, device=dev),
        tw=torch.empty(S, K, dtype=torch.float32, device=dev),
        elist=torch.zeros(DMAX, dtype=torch.int32, device=dev),
        nd=torch.zeros(1, dtype=torch.int32, device=dev),
        v=torch.empty(DMAX, S, RI, dtype=torch.float16 if fmt in MX_ACT else torch.bfloat16, device=dev),
        vs=torch.empty(DMAX, S, RI // 32, dtype=torch.int32, device=dev),
        x1part=torch.empty(X1S if X1S > 1 else 0, SP, DMAX * 2 * RI, dtype=torch.float32, device=dev),
        contrib=torch.empty(S, K, LAT, dtype=torch.bfloat16, device=dev),
        y=torch.empty(S, LAT, dtype=torch.bfloat16, device=dev),
        fin=torch.empty(S, H, dtype=torch.bfloat16, device=dev),
        ln=torch.empty(S, LAT, dtype=torch.bfloat16, device=dev),
        ctr=torch.zeros(8 + 2 * S, dtype=torch.int32, device=dev),
        ctr_up=torch.zeros(8 + 2 * S, dtype=torch.int32, device=dev),
        ctr_lb=torch.zeros(LAT // 16, dtype=torch.int32, device=dev),  # any BL >= 16
        ctr_x1=torch.zeros(DMAX * NCH, dtype=torch.int32, device=dev),
        kpart=torch.empty(16, SP, max(H, E + LAT + 2 * SI), dtype=torch.float32, device=dev),  # K-split partials
        ctr_n=torch.zeros(triton_cdiv(H, 16), dtype=torch.int32, device=dev),
        ctr_u=torch.zeros(triton_cdiv(UPN, 16), dtype=torch.int32, device=dev),
        ctr_m=torch.zeros(triton_cdiv(E, 16) + LAT // 16 + triton_cdiv(SI, 16), dtype=torch.int32, device=dev)))
    tp = taps is not None

    # L1: o_proj partial
    bn = T["k2_bn"]
    bko = _bk(P, T["k2_bk"])
    spl = _split(P // bko, T["o_split"])
    _launch(_k1.gemv_kernel, (triton_cdiv(H, bn) * spl,), core, core.stride(0), S, w_o, w_o.stride(0), sc["part"], H,
            H, P, sc["kpart"], sc["ctr_n"], BN=bn, BK=bko, SP=SP, SPLIT=spl, STAG=T["stag"], SWAP=T["k2_swap"],
            num_warps=T["k2_warps"], num_stages=T["k2_stages"], **_pdl(dev, T))
    # reduction 1 (rank-order fp32); delta = bf16(sum) inside the next launch
    d32 = comm.all_reduce(sc["part"], rank).contiguous()
    # L2: prefix update, AttnRes, norm, router + latent-down + shared gate/up GEMVs, top-k
    bkm = _bk(H, T["mid_bk"])
    spm = _split(H // bkm, T["mid_split"])
    _launch(_k2.k2_mid_kernel, (3 * S * ar["CH"] + (NG + NL + NS) * spm,), sc["ctr"], prefix, H, d32, d32.stride(0),
            blocks, blocks.stride(0), blocks.stride(1), ares_nw, ares_qk, in_nw, sc["x"], sc["tapd"], sc["apart"],
            sc["mix"], sc["msq"], w_gate, w_gate.stride(0), sc["logits"], sc["cand"], sc["csig"], w_ld, w_ld.stride(0), sc["lat"],
            sc["latq"], sc["lats"], w_sgu, w_sgu.stride(0), sc["h"], bias, sc["ids"], sc["tw"], sc["elist"], sc["nd"],
            sc["kpart"], sc["ctr_m"], S, H, ar["HC"], ar["CH"], E, LAT, SI, NG, NL, NS, key.eps, key.out_eps,
            T["spin"], NB=NB, NBP=ar["NBP"], CHP=ar["CHP"], BHC=ar["BHC"], ADD=3 if key.reset else 2, BN=bnm,
            BNL=BNL, BNS=BNS, BK=bkm, SP=SP, K=K, KP=_p2(K), KL=KL, CP=_p2(NG * KL), TP=_p2(S), FMT=FMT_CODE[fmt],
            BETA=key.situ_beta, LBETA=key.situ_linear_beta, SPLIT=spm, STAG=T["stag"], SWAP=T["mid_swap"], TAPS=tp,
            LD=T["poll_ld"], **_nap(dev, T), num_warps=T["mid_warps"], num_stages=T["mid_stages"], **_pdl(dev, T))
    # L3: routed gemm1 + SiTU (+ v quantization), shared down -> fin
    f = FMT_CODE[fmt]
    row = fmt == "mxfp4" and S == 1  # one token row: FMA dot products (_k2._xrow) may replace the MMAs
    nv = dev.type == "cuda" and torch.version.hip is None  # NVIDIA: the PTX nibble decode may be used
    act = sc["lat"] if fmt == "bf16" else sc["latq"]  # perm32 order for the quantized formats
    w13s_ = w13s if packed else w13
    bsd = T["sd_bn"]
    _launch(_k2.k2_exp1_kernel, (DMAX * NCH * X1S + triton_cdiv(H, bsd),), sc["elist"], sc["nd"], act, sc["lats"],
            w13, w13s_, w13.stride(0), w13.stride(1), w13s_.stride(0), w13s_.stride(1), sc["v"], sc["vs"], sc["h"],
            w_sd, w_sd.stride(0), sc["fin"], sc["x1part"], sc["ctr_x1"], S, LAT, RI, H, SI, NCH, DMAX, FMT=f, BR=BR,
            SP=SP, UNR=UNR1, X1S=X1S, BN=bsd, BK=_bk(SI, T["sd_bk"]), BETA=key.situ_beta, LBETA=key.situ_linear_beta,
            STAG=T["stag"], SWAP=T["x1_swap"], ROW=row and T["x1_row"], SLOAD=T["x1_sload"], PTX=nv and T["x1_ptx"],
            SW=T["x1_sw"] and _words_ok(w13s_, UNR1), num_warps=T["x1_warps"], num_stages=T["x1_stages"], **_pdl(dev, T))
    if tp:
        sh_tap = sc["fin"].clone()
    # L4: routed gemm2, contributions, pick-order sum y
    w2s_ = w2s if packed else w2
    UNR2 = _unr(RI, T["x2_unr"])
    _launch(_k2.k2_exp2_kernel, (NLB * DMAX,), sc["elist"], sc["nd"], sc["ids"], sc["tw"], sc["v"], sc["vs"], w2,
            w2s_, w2.stride(0), w2.stride(1), w2s_.stride(0), w2s_.stride(1), sc["contrib"], sc["y"], sc["ctr_lb"],
            S, LAT, RI, DMAX, FMT=f, BL=BL, SP=SP, UNR=UNR2, K=K, KP=_p2(K), STAG=T["stag"],
            SWAP=T["x2_swap"], ROW=row and T["x2_row"], SLOAD=T["x2_sload"], PTX=nv and T["x2_ptx"],
            SW=T["x2_sw"] and _words_ok(w2s_, UNR2), num_warps=T["x2_warps"], num_stages=T["x2_stages"], **_pdl(dev, T))
    # reduction 2; Ls = bf16(sum) inside the next launch
    ls32 = comm.all_reduce(sc["y"], rank).contiguous()
    # L5: latent norm + this rank's up-projection columns
    bup = T["up_bn"]
    bku = _bk(LAT, T["up_bk"])
    spu = _split(LAT // bku, T["up_split"])
    _launch(_k2.k2_up_kernel, (S + triton_cdiv(UPN, bup) * spu,), sc["ctr_up"], ls32, ln_w, sc["ln"], w_up,
            w_up.stride(0), sc["fin"], sc["kpart"], sc["ctr_u"], S, LAT, H, UPN, rank * UPN, key.ln_eps, T["spin"],
            BN=bup, BK=bku, SP=SP, LATP=_p2(LAT), SPLIT=spu, STAG=T["stag"], SWAP=T["up_swap"], TP=_p2(S),
            LD=T["poll_ld"], **_nap(dev, T), num_warps=T["up_warps"], num_stages=T["k2_stages"], **_pdl(dev, T))
    # reduction 3; out = bf16(sum) (the copy is the rounding)
    out.copy_(comm.all_reduce(sc["fin"], rank))
    if tp:
        taps.update(delta=sc["tapd"].clone(), x=sc["x"].clone(), logits=sc["logits"].clone(),
                    topk_ids=sc["ids"].clone(), topk_w=sc["tw"].clone(), lat=sc["lat"].clone(), sh=sh_tap,
                    y=sc["y"].clone(), ln=sc["ln"].clone(), fin=sc["fin"].clone())


def _words_ok(scales: torch.Tensor, unr: int) -> bool:
    """Whether a step's UNR scale codes of every row can load as one aligned word (_k2._words)."""
    return scales.element_size() == 1 and scales.stride(-1) == 1 and scales.data_ptr() % unr == 0 and \
        all(st % unr == 0 for st in scales.stride()[:-1])


def _unr(kd: int, want: int) -> int:
    """Quant blocks per loop step: the largest power of two <= want dividing kd/32."""
    nb = kd // 32
    u = max(1, want)
    while nb % u:
        u //= 2
    return u


# Counters of the in-kernel handshakes, per scratch tag: (name, launch in words, ticketed: ctr[3] is
# its spin-overflow flag). Every one is back at 0 after a completed launch.
_COUNTERS = {
    "k1": (("ctr", "k1 attnres+in_proj", True), ("ctr_rec", "k1 conv+recurrence (gated-norm handshake)", False),
           ("ctr_n", "k1 in_proj (K-split handshake)", False),
           ("ctr_cnt", "k1 in_proj -> recurrence count (rec_cnt)", True)),
    "k2": (("ctr", "k2 attnres+router/latent/shared", True), ("ctr_up", "k2 latent norm+up_proj", True),
           ("ctr_m", "k2 router/latent/shared (K-split handshake)", False),
           ("ctr_n", "k2 o_proj (K-split handshake)", False), ("ctr_u", "k2 up_proj (K-split handshake)", False),
           ("ctr_x1", "k2 routed gemm1 (K-split handshake)", False),
           ("ctr_lb", "k2 routed gemm2 (pick-order sum handshake)", False)),
}


def health() -> list[str]:
    """Problems the kernels flagged since the last call, one line each ([] = healthy): a ticket
    wait that gave up (spin budget exhausted: the launch then computed on rows nobody had
    written), or a handshake counter left non-zero (a launch that did not complete). Reads the
    counters of every build (one device sync) and clears them."""
    items = [(k, name, what, tick, sc[name]) for k, sc in _SCRATCH.items() for name, what, tick in _COUNTERS[k[0]]
             if name in sc]
    if not items:
        return []
    with _LOCK:
        vals = [t.tolist() for t in torch.cat([it[4].flatten() for it in items]).cpu().split(
            [it[4].numel() for it in items])]
        for it in items:
            it[4].zero_()
    out = []
    for (k, name, what, tick, _), v in zip(items, vals):
        where = f"on device {k[2]}" + (f" (rank {k[4]})" if k[0] == "k2" else "")
        if tick and v[3]:
            out.append(f"{what}: ticket wait timed out (spin budget exhausted) in {v[3]} program(s) {where}")
        left = [i for i, x in enumerate(v) if x and not (tick and i == 3)]
        if left:
            out.append(f"{what}: handshake counters not reset after the launch ({name}[{left[0]}] = {v[left[0]]}"
                       f"{f' and {len(left) - 1} more' if len(left) > 1 else ''}) {where}")
    return out


def debug_state(key, dev, rank=0) -> dict:
    """Scratch of a build (tests read the counters and the spin-overflow flag)."""
    return {k: v for k, v in _SCRATCH.items() if k[1] == key and k[2] == str(dev) and k[4] == rank}
