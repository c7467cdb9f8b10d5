"""K2 (o_proj all-reduce, MLP AttnRes, latent MoE) kernels. Launches: o_proj | reduce |
[attnres + router/latent/shared-gate-up GEMVs + top-k] | [routed gemm1 + shared down] |
[routed gemm2 + pick-order sum] | reduce | [latent norm + up projection] | reduce.
docs/triton.md has the plan."""
from __future__ import annotations

import triton
import triton.language as tl

from ._jit import (ares_phases, bf16, e2m1_f16x2, e2m1_f16x2_ptx, e8m0, gemv, int4_bf16x2, mma, mx8_quant_rows,
                   mx_quant_rows, pdl_enter, perm32, pow2, rsqrt, sigmoid, situ, splitk, ticket_done, wait_ge)


@triton.jit
def _packed_keys(lg, rng, rs, S, E, bias_ptr):
    """Router keys of logits lg [R, C] (rows rs, experts rng) packed in one int64 that orders
    like (key, -id): key = σ + bias (-0 as +0) mapped to an order-preserving unsigned image,
    NaN just above -1, the empty slots (rows >= S, experts >= E) -1. Also σ (NaN and empty
    slots as 0)."""
    m2 = (rs < S)[:, None] & (rng < E)[None, :]
    sig = sigmoid(lg)
    key = sig + tl.load(bias_ptr + rng, mask=rng < E, other=0.0)[None, :]
    key = tl.where(key == 0.0, 0.0, key)  # -0 ties with +0
    bits = key.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    srt = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
    srt = tl.where(key != key, 0x7FFFFF, srt)  # NaN ranks below every number
    pk = tl.where(m2, srt * 0x80000000 + (E - 1 - rng)[None, :], -1)
    return pk, tl.where(m2 & (sig == sig), sig, 0.0)


@triton.jit
def _topk_local(tot, rng, S, E, bias_ptr, cand_ptr, csig_ptr, col0, NGKL, KL: tl.constexpr, SP: tl.constexpr):
    """The KL best packed keys of one router block per row -> cand[t, col0 : col0+KL] (largest
    first), their σ -> csig (the packed key names one expert, so the match is unique)."""
    rs = tl.arange(0, SP)
    pk, sig = _packed_keys(tot, rng, rs, S, E, bias_ptr)
    for k in tl.static_range(KL):
        mx = tl.max(pk, axis=1)
        hit = pk == mx[:, None]
        tl.store(cand_ptr + rs * NGKL + col0 + k, mx, mask=rs < S)
        tl.store(csig_ptr + rs * NGKL + col0 + k, tl.sum(tl.where(hit, sig, 0.0), axis=1), mask=rs < S)
        pk = tl.where(hit, -1, pk)


@triton.jit
def _topk_merge(cand_ptr, csig_ptr, ids_ptr, tw_ptr, elist_ptr, nd_ptr, S, E, NGKL,
                K: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr, TP: tl.constexpr):
    """Top-k of every row from the router blocks' candidates (the union of per-block top-k holds
    the row's top-k), DESIGN §5 K2.4: each round the largest key, the lowest id among equal
    keys; w = σ / Σσ with the sum in pick order (NaN σ as 0). Then the distinct picks as an
    ascending list elist[0:nd] and their count nd."""
    rt = tl.arange(0, TP)
    rc = tl.arange(0, CP)
    rk = tl.arange(0, KP)
    rm = rt < S
    cm = rm[:, None] & (rc < NGKL)[None, :]
    pk = tl.load(cand_ptr + rt[:, None] * NGKL + rc[None, :], mask=cm, other=-1, cache_modifier=".cg")
    cs = tl.load(csig_ptr + rt[:, None] * NGKL + rc[None, :], mask=cm, other=0.0, cache_modifier=".cg")
    ids = tl.zeros((TP, KP), dtype=tl.int32)
    sk = tl.zeros((TP, KP), dtype=tl.float32)
    tot = tl.zeros((TP,), dtype=tl.float32)
    for k in tl.static_range(K):
        mx = tl.max(pk, axis=1)
        ok = rm & (mx >= 0)
        e = tl.where(ok, (E - 1 - (mx & 0x7FFFFFFF)).to(tl.int32), 0)
        hit = (pk == mx[:, None]) & ok[:, None]
        sg = tl.sum(tl.where(hit, cs, 0.0), axis=1)
        tot = tot + sg
        ids = tl.where(rk[None, :] == k, e[:, None], ids)
        sk = tl.where(rk[None, :] == k, sg[:, None], sk)
        pk = tl.where(hit, -1, pk)
    tot = tl.where(rm, tot, 1.0)  # padding rows (never stored) divide by 1
    w = tl.div_rn(sk, tl.broadcast_to(tot[:, None], (TP, KP)))
    om = rm[:, None] & (rk < K)[None, :]
    tl.store(ids_ptr + rt[:, None] * K + rk[None, :], ids, mask=om)
    tl.store(tw_ptr + rt[:, None] * K + rk[None, :], w, mask=om)
    # distinct picks: first occurrence of each id, ranked by id
    N: tl.constexpr = TP * KP
    fid = tl.reshape(tl.where(om, ids, E), (N,))
    ri = tl.arange(0, N)
    same = fid[None, :] == fid[:, None]
    dup = tl.sum((same & (ri[None, :] < ri[:, None])).to(tl.int32), axis=1) > 0
    uniq = (fid < E) & (dup == 0)
    rank = tl.sum(((fid[None, :] < fid[:, None]) & uniq[None, :]).to(tl.int32), axis=1)
    tl.store(elist_ptr + rank, fid, mask=uniq)
    tl.store(nd_ptr, tl.sum(uniq.to(tl.int32), axis=0))


@triton.jit
def k2_mid_kernel(ctr_ptr, prefix_ptr, sp, d32_ptr, sd, blocks_ptr, sbt, sbb, nw_ptr, qk_ptr, inw_ptr, x_ptr,
                  tapd_ptr, apart_ptr, mix_ptr, msq_ptr, wg_ptr, swg, logits_ptr, cand_ptr, csig_ptr, wld_ptr, swl, lat_ptr,
                  latq_ptr, lats_ptr, wsgu_ptr, sws, h_ptr, bias_ptr, ids_ptr, tw_ptr, elist_ptr, nd_ptr, part_ptr,
                  ctrn_ptr, S, H, HC, CH, E, LAT, SI, NG, NL, NS, eps, out_eps, spin,
                  NB: tl.constexpr, NBP: tl.constexpr, CHP: tl.constexpr, BHC: tl.constexpr, ADD: tl.constexpr,
                  BN: tl.constexpr, BNL: tl.constexpr, BNS: tl.constexpr, BK: tl.constexpr, SP: tl.constexpr,
                  K: tl.constexpr, KP: tl.constexpr, KL: tl.constexpr, CP: tl.constexpr, TP: tl.constexpr,
                  FMT: tl.constexpr, BETA: tl.constexpr, LBETA: tl.constexpr, SPLIT: tl.constexpr,
                  STAG: tl.constexpr, SWAP: tl.constexpr, TAPS: tl.constexpr,
                  PDL: tl.constexpr = False, LD: tl.constexpr = False, NAP: tl.constexpr = 0):
    """Grid (3·S·CH + (NG + NL + NS)·SPLIT,): steps 2-5 and the shared gate/up of step 6, one launch.

    Tickets < 3·S·CH: the AttnRes phases (prefix update, AttnRes, norm; _jit.ares_phases).
    Others wait for all x chunks, then stream one K split of one row block: router rows (the
    block's last split stores the logits and the block's top-KL candidates per row; the last
    router block merges them into the top-k), latent-down rows, or paired shared gate/up rows
    producing h = bf16(SiTU(g, u)). For quantized experts the latent-down rows also write the
    routed GEMM's activation in perm32 order (latq): MXFP4 E2M1 (mxfp4) or E4M3 (a8w4) values
    as fp16 with their E8M0 codes (lats), the bf16 values for int4.
    part: K-split partials [SPLIT, SP, E+LAT+2SI]; ctrn: per row block counters [NG | NL | NS].
    """
    pdl_enter(PDL)
    ticket = tl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
    rs = tl.arange(0, SP)
    sm = (rs < S)[:, None]
    PW = E + LAT + 2 * SI
    NA3 = 3 * S * CH
    if ticket < NA3:
        ares_phases(ticket, ctr_ptr, S, spin, prefix_ptr, sp, d32_ptr, sd, blocks_ptr, sbt, sbb, nw_ptr, qk_ptr,
                    inw_ptr, x_ptr, tapd_ptr, apart_ptr, mix_ptr, msq_ptr, H, HC, CH, eps, out_eps, NB, NBP, CHP,
                    BHC, ADD, -1, TAPS, False, LD, NAP)
    else:
        j = ticket - NA3
        blk = j // SPLIT
        ks = j % SPLIT
        wait_ge(ctr_ptr + 1, S * CH, spin, ctr_ptr + 3, LD, NAP)
        nk = H // BK // SPLIT
        k_lo = ks * nk * BK
        ko = (ticket * STAG) % nk
        if blk < NG:
            ng0 = blk * BN
            rng = ng0 + tl.arange(0, BN)
            acc = gemv(x_ptr, H, S, wg_ptr, swg, ng0, E, k_lo, nk, ko, BN, BK, SP, True, SWAP)
            last, tot = splitk(acc, part_ptr, PW, ctrn_ptr, blk, ks, S, E, ng0, BN, SP, SPLIT)
            if last:
                tl.store(logits_ptr + rs[:, None] * E + rng[None, :], tot, mask=sm & (rng < E)[None, :])
                _topk_local(tot, rng, S, E, bias_ptr, cand_ptr, csig_ptr, blk * KL, NG * KL, KL, SP)
                tl.debug_barrier()
                if tl.atomic_add(ctr_ptr + 4, 1, sem="acq_rel", scope="gpu") == NG - 1:
                    _topk_merge(cand_ptr, csig_ptr, ids_ptr, tw_ptr, elist_ptr, nd_ptr, S, E, NG * KL, K, KP, CP,
                                TP)
        elif blk < NG + NL:
            nl0 = (blk - NG) * BNL
            rnl = nl0 + tl.arange(0, BNL)
            accl = gemv(x_ptr, H, S, wld_ptr, swl, nl0, LAT, k_lo, nk, ko, BNL, BK, SP, True, SWAP)
            lastl, totl = splitk(accl, part_ptr + E, PW, ctrn_ptr, blk, ks, S, LAT, nl0, BNL, SP, SPLIT)
            if lastl:
                lat = bf16(totl)
                om = sm & (rnl < LAT)[None, :]
                tl.store(lat_ptr + rs[:, None] * LAT + rnl[None, :], lat, mask=om)
                if FMT == 1 or FMT == 3:
                    if FMT == 1:
                        q, code = mx_quant_rows(lat.to(tl.float32), SP, BNL)
                    else:
                        q, code = mx8_quant_rows(lat.to(tl.float32), SP, BNL)
                    tl.store(latq_ptr + rs[:, None] * LAT + perm32(rnl)[None, :], q.to(tl.float16), mask=om)
                    rg = nl0 // 32 + tl.arange(0, BNL // 32)
                    tl.store(lats_ptr + rs[:, None] * (LAT // 32) + rg[None, :], code, mask=sm)
                elif FMT == 2:
                    tl.store(latq_ptr + rs[:, None] * LAT + perm32(rnl)[None, :], lat, mask=om)
        else:
            ns0 = (blk - NG - NL) * BNS
            rns = ns0 + tl.arange(0, BNS)
            accg = gemv(x_ptr, H, S, wsgu_ptr, sws, ns0, SI, k_lo, nk, ko, BNS, BK, SP, True, SWAP)
            accu = gemv(x_ptr, H, S, wsgu_ptr + SI * sws, sws, ns0, SI, k_lo, nk, ko, BNS, BK, SP, True, SWAP)
            if SPLIT == 1:
                g = bf16(accg).to(tl.float32)
                u = bf16(accu).to(tl.float32)
                tl.store(h_ptr + rs[:, None] * SI + rns[None, :], bf16(situ(g, u, BETA, LBETA)),
                         mask=sm & (rns < SI)[None, :])
            else:
                om2 = sm & (rns < SI)[None, :]
                pb = part_ptr + E + LAT
                tl.store(pb + (ks * SP + rs[:, None]) * PW + rns[None, :], accg, mask=om2)
                tl.store(pb + (ks * SP + rs[:, None]) * PW + SI + rns[None, :], accu, mask=om2)
                tl.debug_barrier()
                if tl.atomic_add(ctrn_ptr + blk, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                    tl.atomic_xchg(ctrn_ptr + blk, 0, sem="relaxed", scope="gpu")
                    tl.debug_barrier()
                    tg = tl.zeros((SP, BNS), dtype=tl.float32)
                    tu = tl.zeros((SP, BNS), dtype=tl.float32)
                    for kk in tl.static_range(SPLIT):
                        tg += tl.load(pb + (kk * SP + rs[:, None]) * PW + rns[None, :], mask=om2, other=0.0,
                                      cache_modifier=".cg")
                        tu += tl.load(pb + (kk * SP + rs[:, None]) * PW + SI + rns[None, :], mask=om2, other=0.0,
                                      cache_modifier=".cg")
                    g2 = bf16(tg).to(tl.float32)
                    u2 = bf16(tu).to(tl.float32)
                    tl.store(h_ptr + rs[:, None] * SI + rns[None, :], bf16(situ(g2, u2, BETA, LBETA)), mask=om2)
    ticket_done(ctr_ptr, NA3 + (NG + NL + NS) * SPLIT, S, TP)


@triton.jit
def _nib(b, PTX: tl.constexpr):
    """Packed E2M1 bytes -> (low, high nibble) fp16 planes (value·2^-14), PTX or portable."""
    if PTX:
        return e2m1_f16x2_ptx(b)
    else:
        return e2m1_f16x2(b)


@triton.jit
def _xblock(b, ae, ao, fa, fw, acc, FMT: tl.constexpr, BR: tl.constexpr, SP: tl.constexpr, SWAP: tl.constexpr,
            PTX: tl.constexpr):
    """acc + one 32-K block of one row set: the low/high nibble planes of b [BR, 16] against the
    even/odd activation halves ae/ao [SP, 16]; the block's exact sum scaled by its powers of
    two (fa [SP] activation, fw [BR] weight; mxfp4/a8w4) or its bf16 scale (fw; int4)."""
    if FMT != 2:
        lo, hi = _nib(b, PTX)
    else:
        lo, hi = int4_bf16x2(b)
    if SWAP:
        d = mma(hi, tl.trans(ao), mma(lo, tl.trans(ae), tl.zeros((BR, SP), dtype=tl.float32)))
        if FMT != 2:
            return acc + d * fw[:, None] * fa[None, :]
        else:
            return acc + d * fw[:, None]
    else:
        d = mma(ao, tl.trans(hi), mma(ae, tl.trans(lo), tl.zeros((SP, BR), dtype=tl.float32)))
        if FMT != 2:
            return acc + d * fa[:, None] * fw[None, :]
        else:
            return acc + d * fw[None, :]


@triton.jit
def _xrow(wrow, srow, wrow2, srow2, a_ptr, as_ptr, ks0, nk, koff, BR: tl.constexpr, SP: tl.constexpr,
          UNR: tl.constexpr, TWO: tl.constexpr, PTX: tl.constexpr):
    """xgemm for one token row of mxfp4 (S == 1) by FMA dot products instead of MMAs: per 32 of K
    the row's exact block sum (E2M1·E2M1 products and their sums of 32 are exact in fp32, so
    the order inside a block does not matter) scaled as d·fa·fw and added in the same step /
    block order as the MMA path, so the result is the MMA path's bit for bit. Rows 1.. of the
    [SP, BR] results are 0."""
    r16 = tl.arange(0, 16)
    ru = tl.arange(0, UNR)
    acc = tl.zeros((BR,), dtype=tl.float32)
    acc2 = acc
    kc = ks0 + koff % nk
    s_nx = tl.load(srow[:, None] + kc * UNR + ru[None, :])
    if TWO:
        s2_nx = tl.load(srow2[:, None] + kc * UNR + ru[None, :])
    a_nx = tl.load(as_ptr + kc * UNR + ru)
    for it in range(0, nk):
        kc = ks0 + (it + koff) % nk
        kn = ks0 + (it + 1 + koff) % nk
        s_cu = s_nx
        s_nx = tl.load(srow[:, None] + kn * UNR + ru[None, :])
        if TWO:
            s2_cu = s2_nx
            s2_nx = tl.load(srow2[:, None] + kn * UNR + ru[None, :])
        a_cu = a_nx
        a_nx = tl.load(as_ptr + kn * UNR + ru)
        for uu in tl.static_range(UNR):
            kb = kc * UNR + uu
            ae = tl.load(a_ptr + kb * 32 + r16).to(tl.float32)
            ao = tl.load(a_ptr + kb * 32 + 16 + r16).to(tl.float32)
            fa = pow2(tl.sum(tl.where(ru == uu, a_cu, 0), axis=0) - 113)  # 2^(sa-127)·2^14
            lo, hi = _nib(tl.load(wrow[:, None] + kb * 16 + r16[None, :]), PTX)
            d = tl.sum(lo.to(tl.float32) * ae[None, :] + hi.to(tl.float32) * ao[None, :], axis=1)
            fw = e8m0(tl.sum(tl.where(ru[None, :] == uu, s_cu.to(tl.int32), 0), axis=1))
            acc = acc + d * fa * fw
            if TWO:
                lo2, hi2 = _nib(tl.load(wrow2[:, None] + kb * 16 + r16[None, :]), PTX)
                d2 = tl.sum(lo2.to(tl.float32) * ae[None, :] + hi2.to(tl.float32) * ao[None, :], axis=1)
                fw2 = e8m0(tl.sum(tl.where(ru[None, :] == uu, s2_cu.to(tl.int32), 0), axis=1))
                acc2 = acc2 + d2 * fa * fw2
    row0 = (tl.arange(0, SP) == 0)[:, None]
    return tl.where(row0, acc[None, :], 0.0), tl.where(row0, acc2[None, :], 0.0)


@triton.jit
def _codes(c, ru, UNR: tl.constexpr):
    """[N, UNR] E8M0 codes -> [N] words holding code u in byte u (bytes disjoint: the sum is exact)."""
    if UNR > 4:
        return tl.sum(c.to(tl.int64) << (ru * 8).to(tl.int64)[None, :], axis=1)
    else:
        return tl.sum(c.to(tl.int32) << (ru * 8)[None, :], axis=1)


@triton.jit
def _words(p, kc, UNR: tl.constexpr):
    """The UNR E8M0 codes of step kc at each of the pointers p (UNR consecutive bytes, aligned
    to UNR) as one little-endian word: code u in byte u, the form _codes builds."""
    if UNR == 8:
        return tl.load((p + kc * UNR).to(tl.pointer_type(tl.int64)))
    elif UNR == 4:
        return tl.load((p + kc * UNR).to(tl.pointer_type(tl.int32)))
    elif UNR == 2:
        return tl.load((p + kc * UNR).to(tl.pointer_type(tl.int16))).to(tl.int32) & 0xFFFF
    else:
        return tl.load(p + kc).to(tl.int32)


@triton.jit
def _step_codes(p, kc, ru, UNR: tl.constexpr, WL: tl.constexpr):
    """A weight row's scales of step kc at each of the row pointers p: one word per row (WL,
    _words) or the [rows, UNR] bytes."""
    if WL:
        return _words(p, kc, UNR)
    else:
        return tl.load(p[:, None] + kc * UNR + ru[None, :])


@triton.jit
def _code(w, uu: tl.constexpr):
    """Byte uu of the words w, as int32."""
    return ((w >> (8 * uu)) & 0xFF).to(tl.int32)


@triton.jit
def xgemm(wrow, srow, wrow2, srow2, a_ptr, sar, as_ptr, sasr, S, ks0, nk, koff, FMT: tl.constexpr,
          BR: tl.constexpr, SP: tl.constexpr, UNR: tl.constexpr, SWAP: tl.constexpr, TWO: tl.constexpr,
          ROW: tl.constexpr = False, SLOAD: tl.constexpr = False, PTX: tl.constexpr = False,
          SW: tl.constexpr = False):
    """(acc, acc2) [SP, BR] = a[:S] @ W[rows]^T over the K steps [ks0, ks0+nk) of 32·UNR, for one
    expert's rows in its own format; with TWO a second row set (wrow2/srow2) shares every
    activation load (gemm1's gate and up rows).

    wrow/srow: [BR] pointers to each row's weights / scales. FMT 0 bf16 (a natural order);
    1 mxfp4 / 3 a8w4 (a: E2M1 / E4M3 values as fp16 in perm32 order, E8M0 codes per 32 in
    as_ptr); 2 int4 (a: bf16 in perm32 order). Quantized blocks: per 32 of K a 16-byte load
    per row, see _xblock; the block sums are added in fp32 in step order from step koff
    (rotated), blocks in order within a step. The scales of the next step are loaded one step
    ahead (SLOAD: loaded per block instead). SWAP puts the weights on the MMA's M side (see gemv).
    ROW (mxfp4, S == 1): _xrow. PTX: the E2M1 decode as inline PTX (NVIDIA; same bits). SW
    (mxfp4 / a8w4 with the step prefetch): the weights' codes of a step loaded as one word per
    row (_step_codes; the host checks the strides, _host._words_ok).
    """
    if ROW:
        return _xrow(wrow, srow, wrow2, srow2, a_ptr, as_ptr, ks0, nk, koff, BR, SP, UNR, TWO, PTX)
    rs = tl.arange(0, SP)
    sm = rs < S
    if SWAP:
        acc = tl.zeros((BR, SP), dtype=tl.float32)
    else:
        acc = tl.zeros((SP, BR), dtype=tl.float32)
    acc2 = acc
    if FMT == 0:
        rk = tl.arange(0, 32 * UNR)
        for it in range(0, nk):
            k0 = (ks0 + (it + koff) % nk) * (32 * UNR)
            a = tl.load(a_ptr + rs[:, None] * sar + k0 + rk[None, :], mask=sm[:, None], other=0.0)
            w = tl.load(wrow[:, None] + k0 + rk[None, :])
            if SWAP:
                acc = mma(w, tl.trans(a), acc)
            else:
                acc = mma(a, tl.trans(w), acc)
            if TWO:
                w2 = tl.load(wrow2[:, None] + k0 + rk[None, :])
                if SWAP:
                    acc2 = mma(w2, tl.trans(a), acc2)
                else:
                    acc2 = mma(a, tl.trans(w2), acc2)
    else:
        r16 = tl.arange(0, 16)
        ru = tl.arange(0, UNR)
        kc = ks0 + koff % nk
        PF: tl.constexpr = not SLOAD
        WL: tl.constexpr = SW and FMT != 2
        if PF:
            s_nx = _step_codes(srow, kc, ru, UNR, WL)
            if TWO:
                s2_nx = _step_codes(srow2, kc, ru, UNR, WL)
            if FMT != 2:
                a_nx = tl.load(as_ptr + rs[:, None] * sasr + kc * UNR + ru[None, :], mask=sm[:, None], other=0)
        for it in range(0, nk):
            kc = ks0 + (it + koff) % nk
            kn = ks0 + (it + 1 + koff) % nk
            if PF:
                s_cu = s_nx
                s_nx = _step_codes(srow, kn, ru, UNR, WL)
                if TWO:
                    s2_cu = s2_nx
                    s2_nx = _step_codes(srow2, kn, ru, UNR, WL)
                if FMT != 2:  # the step's codes as one word per row, code uu in byte uu: no per-block reductions
                    a_cu = a_nx
                    a_nx = tl.load(as_ptr + rs[:, None] * sasr + kn * UNR + ru[None, :], mask=sm[:, None], other=0)
                    a_w = _codes(a_cu, ru, UNR)  # the activation codes are int32, one per element
                    if WL:
                        s_w = s_cu
                        if TWO:
                            s2_w = s2_cu
                    else:
                        s_w = _codes(s_cu, ru, UNR)
                        if TWO:
                            s2_w = _codes(s2_cu, ru, UNR)
            for uu in tl.static_range(UNR):
                kb = kc * UNR + uu
                b = tl.load(wrow[:, None] + kb * 16 + r16[None, :])
                if TWO:
                    b2 = tl.load(wrow2[:, None] + kb * 16 + r16[None, :])
                ae = tl.load(a_ptr + rs[:, None] * sar + kb * 32 + r16[None, :], mask=sm[:, None], other=0.0)
                ao = tl.load(a_ptr + rs[:, None] * sar + kb * 32 + 16 + r16[None, :], mask=sm[:, None], other=0.0)
                if SLOAD:  # the block's scales loaded where they are used (L1-hot: the step's share lines)
                    if FMT != 2:
                        fa = pow2(tl.load(as_ptr + rs * sasr + kb, mask=sm, other=0).to(tl.int32) - 113)
                        fw = e8m0(tl.load(srow + kb))
                        if TWO:
                            fw2 = e8m0(tl.load(srow2 + kb))
                    else:
                        fw = tl.load(srow + kb).to(tl.float32)
                        fa = fw
                        if TWO:
                            fw2 = tl.load(srow2 + kb).to(tl.float32)
                elif FMT != 2:
                    fa = pow2(_code(a_w, uu) - 113)  # 2^(sa-127)·2^14
                    fw = e8m0(_code(s_w, uu))
                    if TWO:
                        fw2 = e8m0(_code(s2_w, uu))
                else:
                    fw = tl.sum(tl.where(ru[None, :] == uu, s_cu.to(tl.float32), 0.0), axis=1)
                    fa = fw
                    if TWO:
                        fw2 = tl.sum(tl.where(ru[None, :] == uu, s2_cu.to(tl.float32), 0.0), axis=1)
                acc = _xblock(b, ae, ao, fa, fw, acc, FMT, BR, SP, SWAP, PTX)
                if TWO:
                    acc2 = _xblock(b2, ae, ao, fa, fw2, acc2, FMT, BR, SP, SWAP, PTX)
    if SWAP:
        return tl.trans(acc), tl.trans(acc2)
    else:
        return acc, acc2


@triton.jit
def k2_exp1_kernel(elist_ptr, nd_ptr, a_ptr, as_ptr, w_ptr, ws_ptr, w_se, w_sr, ws_se, ws_sr, v_ptr, vs_ptr,
                   h_ptr, wsd_ptr, swsd, fin_ptr, part_ptr, ctr_ptr, S, LAT, RI, H, SI, NCH, DMAX,
                   FMT: tl.constexpr, BR: tl.constexpr, SP: tl.constexpr, UNR: tl.constexpr, X1S: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, BETA: tl.constexpr, LBETA: tl.constexpr, STAG: tl.constexpr,
                   SWAP: tl.constexpr, ROW: tl.constexpr, SLOAD: tl.constexpr, PTX: tl.constexpr,
                   SW: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid (DMAX·NCH·X1S + cdiv(H, BN),): routed gemm1 + SiTU for (distinct pick i, RI chunk c,
    K split ks), then the shared-expert down projection sh -> fin (the up projection adds to it
    later).

    With X1S > 1 the K split partials of gate and up go to part [X1S, SP, DMAX·2RI] and the last
    program of (i, c) (acq_rel counter) adds them in split order. v is kept per pick slot
    (perm32 order for the quantized formats): mxfp4 / a8w4 quantize it per 32 (never rounded to
    bf16), the other formats round it to bf16. Slots past the number of distinct picks return
    at once.
    """
    pdl_enter(PDL)
    pid = tl.program_id(0)
    rs = tl.arange(0, SP)
    sm = (rs < S)[:, None]
    if pid < DMAX * NCH * X1S:
        ks = pid % X1S
        ic = pid // X1S
        i = ic // NCH
        c = ic % NCH
        if i < tl.load(nd_ptr):
            e = tl.load(elist_ptr + i).to(tl.int64)
            rr = c * BR + tl.arange(0, BR)
            wb = w_ptr + e * w_se
            sb = ws_ptr + e * ws_se
            nk = LAT // (32 * UNR) // X1S
            g, u = xgemm(wb + rr * w_sr, sb + rr * ws_sr, wb + (RI + rr) * w_sr, sb + (RI + rr) * ws_sr, a_ptr, LAT,
                         as_ptr, LAT // 32, S, ks * nk, nk, (pid * STAG) % nk, FMT, BR, SP, UNR, SWAP, True, ROW, SLOAD,
                         PTX, SW)
            last = True
            if X1S > 1:
                pw = DMAX * 2 * RI
                po = part_ptr + (ks * SP + rs[:, None]) * pw + i * 2 * RI + rr[None, :]
                tl.store(po, g, mask=sm)
                tl.store(po + RI, u, mask=sm)
                tl.debug_barrier()
                last = tl.atomic_add(ctr_ptr + ic, 1, sem="acq_rel", scope="gpu") == X1S - 1
                if last:
                    tl.atomic_xchg(ctr_ptr + ic, 0, sem="relaxed", scope="gpu")
                    tl.debug_barrier()
                    g = tl.zeros((SP, BR), dtype=tl.float32)
                    u = tl.zeros((SP, BR), dtype=tl.float32)
                    for kk in tl.static_range(X1S):
                        pk = part_ptr + (kk * SP + rs[:, None]) * pw + i * 2 * RI + rr[None, :]
                        g += tl.load(pk, mask=sm, other=0.0, cache_modifier=".cg")
                        u += tl.load(pk + RI, mask=sm, other=0.0, cache_modifier=".cg")
            if last:
                v = situ(g, u, BETA, LBETA)
                if FMT == 0:
                    vo = v_ptr + i * S * RI + rs[:, None] * RI + rr[None, :]
                else:
                    vo = v_ptr + i * S * RI + rs[:, None] * RI + perm32(rr)[None, :]
                if FMT == 1 or FMT == 3:
                    if FMT == 1:
                        q, code = mx_quant_rows(v, SP, BR)
                    else:
                        q, code = mx8_quant_rows(v, SP, BR)
                    tl.store(vo, q.to(tl.float16), mask=sm)
                    rg = c * (BR // 32) + tl.arange(0, BR // 32)
                    tl.store(vs_ptr + i * S * (RI // 32) + rs[:, None] * (RI // 32) + rg[None, :], code, mask=sm)
                else:
                    tl.store(vo, bf16(v), mask=sm)
    else:
        n0 = (pid - DMAX * NCH * X1S) * BN
        rn = n0 + tl.arange(0, BN)
        nks = SI // BK
        acc = gemv(h_ptr, SI, S, wsd_ptr, swsd, n0, H, 0, nks, (pid * STAG) % nks, BN, BK, SP, False, SWAP)
        tl.store(fin_ptr + rs[:, None] * H + rn[None, :], bf16(acc), mask=sm & (rn < H)[None, :])


@triton.jit
def k2_exp2_kernel(elist_ptr, nd_ptr, ids_ptr, tw_ptr, v_ptr, vs_ptr, w_ptr, ws_ptr, w_se, w_sr, ws_se, ws_sr,
                   contrib_ptr, y_ptr, ctr_ptr, S, LAT, RI, DMAX,
                   FMT: tl.constexpr, BL: tl.constexpr, SP: tl.constexpr, UNR: tl.constexpr,
                   K: tl.constexpr, KP: tl.constexpr, STAG: tl.constexpr, SWAP: tl.constexpr, ROW: tl.constexpr,
                   SLOAD: tl.constexpr, PTX: tl.constexpr, SW: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid (NLB·DMAX,): routed gemm2 for (latent block lb, distinct pick i) -> contrib[t, k] =
    bf16(acc·w) for every token t that picked it (at its rank k); the last program of a
    latent block (acq_rel counter) sums y = bf16(y + contrib_k) in pick order for the block.
    """
    pdl_enter(PDL)
    pid = tl.program_id(0)
    lb = pid // DMAX
    i = pid % DMAX
    rs = tl.arange(0, SP)
    sm = rs < S
    rl = lb * BL + tl.arange(0, BL)
    if i < tl.load(nd_ptr):
        e = tl.load(elist_ptr + i)
        rk = tl.arange(0, KP)
        km = sm[:, None] & (rk < K)[None, :]
        hit = tl.load(ids_ptr + rs[:, None] * K + rk[None, :], mask=km, other=-1) == e
        has = tl.max(hit.to(tl.int32), axis=1) > 0
        kpos = tl.sum(tl.where(hit, rk[None, :], 0), axis=1)
        wt = tl.sum(tl.where(hit, tl.load(tw_ptr + rs[:, None] * K + rk[None, :], mask=km, other=0.0), 0.0), axis=1)
        e64 = e.to(tl.int64)
        ko = (pid * STAG) % (RI // (32 * UNR))
        acc, _ = xgemm(w_ptr + e64 * w_se + rl * w_sr, ws_ptr + e64 * ws_se + rl * ws_sr, w_ptr, ws_ptr,
                       v_ptr + i * S * RI, RI, vs_ptr + i * S * (RI // 32), RI // 32, S, 0, RI // (32 * UNR), ko, FMT,
                       BL, SP, UNR, SWAP, False, ROW, SLOAD, PTX, SW)
        tl.store(contrib_ptr + (rs[:, None] * K + kpos[:, None]) * LAT + rl[None, :], bf16(acc * wt[:, None]),
                 mask=has[:, None])
    tl.debug_barrier()
    if tl.atomic_add(ctr_ptr + lb, 1, sem="acq_rel", scope="gpu") == DMAX - 1:
        tl.atomic_xchg(ctr_ptr + lb, 0, sem="relaxed", scope="gpu")
        tl.debug_barrier()
        y = tl.zeros((SP, BL), dtype=tl.float32)
        for k in tl.static_range(K):
            cb = tl.load(contrib_ptr + (rs[:, None] * K + k) * LAT + rl[None, :], mask=sm[:, None], other=0.0,
                         cache_modifier=".cg")
            y = bf16(y + cb.to(tl.float32)).to(tl.float32)
        tl.store(y_ptr + rs[:, None] * LAT + rl[None, :], y.to(tl.bfloat16), mask=sm[:, None])


@triton.jit
def k2_up_kernel(ctr_ptr, ls_ptr, lnw_ptr, ln_ptr, wup_ptr, swu, fin_ptr, part_ptr, ctrn_ptr, S, LAT, H, UPN, col0,
                 ln_eps, spin, BN: tl.constexpr, BK: tl.constexpr, SP: tl.constexpr, LATP: tl.constexpr,
                 SPLIT: tl.constexpr, STAG: tl.constexpr, SWAP: tl.constexpr, TP: tl.constexpr,
                 PDL: tl.constexpr = False, LD: tl.constexpr = False, NAP: tl.constexpr = 0):
    """Grid (S + cdiv(UPN, BN)·SPLIT,), ticketed like k1_mid: tickets < S compute the latent norm
    of row t, LN = bf16(Ls·rsqrt(mean(Ls²) + ln_eps)·ln_w) with Ls = bf16(reduced y), into
    ln; the others wait for the S rows, then stream one K split of this rank's up-projection
    rows: fin = bf16(sh + LN @ w_up^T) on its columns (the last split adds the partials in split
    order). ctr as in k1_mid (ticket, rows ready, done, spin overflow)."""
    pdl_enter(PDL)
    ticket = tl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
    rs = tl.arange(0, SP)
    sm = (rs < S)[:, None]
    if ticket < S:
        rl = tl.arange(0, LATP)
        lm = rl < LAT
        lv = bf16(tl.load(ls_ptr + ticket * LAT + rl, mask=lm, other=0.0)).to(tl.float32)
        rstd = rsqrt(tl.sum(lv * lv, axis=0) / LAT + ln_eps)
        w = tl.load(lnw_ptr + rl, mask=lm, other=0.0).to(tl.float32)
        tl.store(ln_ptr + ticket * LAT + rl, bf16(lv * rstd * w), mask=lm)
        tl.debug_barrier()
        tl.atomic_add(ctr_ptr + 1, 1, sem="release", scope="gpu")
    else:
        u = ticket - S
        nb = u // SPLIT
        ks = u % SPLIT
        n0 = nb * BN
        rn = n0 + tl.arange(0, BN)
        wait_ge(ctr_ptr + 1, S, spin, ctr_ptr + 3, LD, NAP)
        nk = LAT // BK // SPLIT
        acc = gemv(ln_ptr, LAT, S, wup_ptr, swu, n0, UPN, ks * nk * BK, nk, (ticket * STAG) % nk, BN, BK, SP, True,
                   SWAP)
        last, tot = splitk(acc, part_ptr, UPN, ctrn_ptr, nb, ks, S, UPN, n0, BN, SP, SPLIT)
        if last:
            fo = fin_ptr + rs[:, None] * H + col0 + rn[None, :]
            om = sm & (rn < UPN)[None, :]
            sh = tl.load(fo, mask=om, other=0.0).to(tl.float32)
            tl.store(fo, bf16(sh + tot), mask=om)
    ticket_done(ctr_ptr, S + tl.cdiv(UPN, BN) * SPLIT, S, TP)
