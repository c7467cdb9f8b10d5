"""K2 (o_proj all-reduce, MLP AttnRes, latent MoE) kernels. Launches: o_proj | reduce |
[attnres + router/latent/shared-gate-up GEMVs + top-k] | [routed gemm1 + shared down] |
[routed gemm2 + pick-order sum] | reduce | [latent norm + up projection] | reduce.
docs/triton.md has the plan."""
from __future__ import annotations

import triton
import triton.language as tl

from ._jit import (attnres_row, bf16, e2m1_f16x2, e8m0, gemv, int4_bf16x2, mma, mx8_quant_rows, mx_quant_rows,
                   perm32, pow2,
                   rsqrt, sigmoid, situ, splitk, wait_rows)


@triton.jit
def _topk(logits_ptr, bias_ptr, ids_ptr, tw_ptr, elist_ptr, nd_ptr, S, E,
          K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, TP: tl.constexpr):
    """Router selection for all S rows (DESIGN §5 K2.4) and the sorted list of distinct picks.

    Each round takes the largest key (NaN ranks as -inf, as in the reference), the lowest
    id among equal keys; weights are σ / Σσ with the sum in pick order, NaN σ as 0.
    Rows go in groups of at most 4 to bound registers.
    """
    TG: tl.constexpr = 4 if TP > 4 else TP
    re = tl.arange(0, EP)
    pe = tl.zeros((EP,), dtype=tl.int32)
    for g in tl.static_range(TP // TG):
        pe = tl.maximum(pe, _topk_rows(g * TG, logits_ptr, bias_ptr, ids_ptr, tw_ptr, S, E, K, KP, EP, TG))
    pos = tl.cumsum(pe, axis=0) - 1
    tl.store(elist_ptr + pos, re, mask=pe > 0)
    tl.store(nd_ptr, tl.sum(pe, axis=0))


@triton.jit
def _topk_rows(t0, logits_ptr, bias_ptr, ids_ptr, tw_ptr, S, E, K: tl.constexpr, KP: tl.constexpr,
               EP: tl.constexpr, TG: tl.constexpr):
    """Top-k of rows t0..t0+TG-1; returns the [EP] mask of experts they picked."""
    rt = t0 + tl.arange(0, TG)
    re = tl.arange(0, EP)
    rk = tl.arange(0, KP)
    m2 = (rt < S)[:, None] & (re < E)[None, :]
    lg = tl.load(logits_ptr + rt[:, None] * E + re[None, :], mask=m2, other=0.0, cache_modifier=".cg")
    sig = sigmoid(lg)
    key = sig + tl.load(bias_ptr + re, mask=re < E, other=0.0)[None, :]
    key = tl.where(key == 0.0, 0.0, key)  # -0 ties with +0
    # order-preserving unsigned image of the key (NaN as -inf), then (key, -id) in one int64
    bits = key.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    srt = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
    srt = tl.where(key != key, 0x7FFFFF, srt)
    pk = tl.where(m2, srt * 0x80000000 + (E - 1 - re)[None, :], -1)
    sig0 = tl.where(sig != sig, 0.0, sig)
    ids = tl.zeros((TG, KP), dtype=tl.int32)
    sk = tl.zeros((TG, KP), dtype=tl.float32)
    tot = tl.zeros((TG,), dtype=tl.float32)
    for k in tl.static_range(K):
        mx = tl.max(pk, axis=1)
        hit = (pk == mx[:, None]) & (mx >= 0)[:, None]
        e = (E - 1 - (mx & 0x7FFFFFFF)).to(tl.int32)
        s = tl.sum(tl.where(hit, sig0, 0.0), axis=1)
        tot = tot + s
        ids = tl.where(rk[None, :] == k, e[:, None], ids)
        sk = tl.where(rk[None, :] == k, s[:, None], sk)
        pk = tl.where(hit, -1, pk)
    tot = tl.where(rt < S, tot, 1.0)  # padding rows (never stored) divide by 1
    w = tl.div_rn(sk, tl.broadcast_to(tot[:, None], (TG, KP)))
    om = (rt < S)[:, None] & (rk < K)[None, :]
    tl.store(ids_ptr + rt[:, None] * K + rk[None, :], ids, mask=om)
    tl.store(tw_ptr + rt[:, None] * K + rk[None, :], w, mask=om)
    return tl.max(((pk == -1) & m2).to(tl.int32), axis=0)


@triton.jit
def k2_mid_kernel(ctr_ptr, prefix_ptr, sp, d32_ptr, sd, blocks_ptr, sbt, sbb, nw_ptr, qk_ptr, inw_ptr, x_ptr,
                  tapd_ptr, wg_ptr, swg, logits_ptr, wld_ptr, swl, lat_ptr, latq_ptr, lats_ptr, wsgu_ptr, sws,
                  h_ptr, bias_ptr, ids_ptr, tw_ptr, elist_ptr, nd_ptr, part_ptr, ctrn_ptr,
                  S, H, E, LAT, SI, NG, NL, NS, eps, out_eps,
                  NB: tl.constexpr, NBP: tl.constexpr, BH: tl.constexpr, ADD: tl.constexpr,
                  BN: tl.constexpr, BNL: tl.constexpr, BNS: tl.constexpr, BK: tl.constexpr, SP: tl.constexpr,
                  K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, TP: tl.constexpr, FMT: tl.constexpr,
                  BETA: tl.constexpr, LBETA: tl.constexpr, SPLIT: tl.constexpr, STAG: tl.constexpr,
                  SWAP: tl.constexpr, TAPS: tl.constexpr):
    """Grid (S + (NG + NL + NS)·SPLIT,): steps 2-5 and the shared gate/up of step 6, one launch.

    Tickets (start order) < S: prefix update + AttnRes + norm of one row. Others wait for
    the S rows (see k1_mid_kernel for why the wait ends), then stream one K split of one
    row block: router rows (the block's last split stores the logits; the last router
    block runs the top-k), latent-down rows, or paired shared gate/up rows producing
    h = bf16(SiTU(g, u)). For quantized experts the latent-down rows also write the
    routed GEMM's activation in perm32 order (latq): MXFP4 E2M1 values + codes (lats)
    for mxfp4, the bf16 values for int4. part: K-split partials [SPLIT, SP, E+LAT+2SI];
    ctrn: per row block counters [NG | NL | NS].
    ctr: [ticket, rows ready, programs done, spin overflow, router blocks done].
    """
    ticket = tl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
    rs = tl.arange(0, SP)
    sm = (rs < S)[:, None]
    PW = E + LAT + 2 * SI
    if ticket < S:
        attnres_row(ticket, prefix_ptr, sp, d32_ptr, sd, blocks_ptr, sbt, sbb, nw_ptr, qk_ptr, inw_ptr, x_ptr, H,
                    tapd_ptr, H, eps, out_eps, NB, NBP, BH, ADD, -1, TAPS)
        tl.debug_barrier()
        tl.atomic_add(ctr_ptr + 1, 1, sem="release", scope="gpu")
    else:
        j = ticket - S
        blk = j // SPLIT
        ks = j % SPLIT
        wait_rows(ctr_ptr, S)
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
                tl.debug_barrier()
                if tl.atomic_add(ctr_ptr + 4, 1, sem="acq_rel", scope="gpu") == NG - 1:
                    tl.atomic_xchg(ctr_ptr + 4, 0, sem="relaxed", scope="gpu")
                    tl.debug_barrier()
                    _topk(logits_ptr, bias_ptr, ids_ptr, tw_ptr, elist_ptr, nd_ptr, S, E, K, KP, EP, TP)
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
    tl.debug_barrier()
    if tl.atomic_add(ctr_ptr + 2, 1, sem="acq_rel", scope="gpu") == S + (NG + NL + NS) * SPLIT - 1:
        tl.atomic_xchg(ctr_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(ctr_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(ctr_ptr + 2, 0, sem="relaxed", scope="gpu")


@triton.jit
def xgemm(wrow, srow, a_ptr, sar, as_ptr, sasr, S, KD, koff, FMT: tl.constexpr, BR: tl.constexpr,
          SP: tl.constexpr, UNR: tl.constexpr, SWAP: tl.constexpr):
    """acc[SP, BR] = a[:S, :KD] @ W[rows, :KD]^T for one expert's rows in its own format.

    wrow/srow: [BR] pointers to each row's weights / scales. FMT 0 bf16 (a natural order);
    1 mxfp4 (a: E2M1 values as fp16 in perm32 order, E8M0 codes per 32 in as_ptr); 2 int4
    (a: bf16 in perm32 order). Quantized blocks: per 32 of K a 16-byte load per row, the
    low/high nibble planes against the even/odd halves of the activation block, the
    block's exact sum scaled by its two powers of two (mxfp4) or its bf16 scale (int4) in
    fp32. UNR blocks per step, visited from step koff on; the scales of the next step are
    loaded one step ahead. SWAP puts the weights on the MMA's M side (see gemv).
    """
    rs = tl.arange(0, SP)
    sm = rs < S
    if SWAP:
        acc = tl.zeros((BR, SP), dtype=tl.float32)
    else:
        acc = tl.zeros((SP, BR), dtype=tl.float32)
    if FMT == 0:
        rk = tl.arange(0, 32 * UNR)
        nk = KD // (32 * UNR)
        for it in range(0, nk):
            k0 = ((it + koff) % nk) * (32 * UNR)
            a = tl.load(a_ptr + rs[:, None] * sar + k0 + rk[None, :], mask=sm[:, None], other=0.0)
            w = tl.load(wrow[:, None] + k0 + rk[None, :])
            if SWAP:
                acc = mma(w, tl.trans(a), acc)
            else:
                acc = mma(a, tl.trans(w), acc)
    else:
        r16 = tl.arange(0, 16)
        ru = tl.arange(0, UNR)
        nk = KD // 32 // UNR
        kc = koff % nk
        s_nx = tl.load(srow[:, None] + kc * UNR + ru[None, :])
        if FMT != 2:
            a_nx = tl.load(as_ptr + rs[:, None] * sasr + kc * UNR + ru[None, :], mask=sm[:, None], other=0)
        for it in range(0, nk):
            kc = (it + koff) % nk
            kn = (it + 1 + koff) % nk
            s_cu = s_nx
            s_nx = tl.load(srow[:, None] + kn * UNR + ru[None, :])
            if FMT != 2:
                a_cu = a_nx
                a_nx = tl.load(as_ptr + rs[:, None] * sasr + kn * UNR + ru[None, :], mask=sm[:, None], other=0)
            for uu in tl.static_range(UNR):
                kb = kc * UNR + uu
                b = tl.load(wrow[:, None] + kb * 16 + r16[None, :])
                ae = tl.load(a_ptr + rs[:, None] * sar + kb * 32 + r16[None, :], mask=sm[:, None], other=0.0)
                ao = tl.load(a_ptr + rs[:, None] * sar + kb * 32 + 16 + r16[None, :], mask=sm[:, None], other=0.0)
                if FMT != 2:
                    lo, hi = e2m1_f16x2(b)
                    fa = pow2(tl.sum(tl.where(ru[None, :] == uu, a_cu, 0), axis=1) - 113)  # 2^(sa-127)·2^14
                    fw = e8m0(tl.sum(tl.where(ru[None, :] == uu, s_cu.to(tl.int32), 0), axis=1))
                else:
                    lo, hi = int4_bf16x2(b)
                    fw = tl.sum(tl.where(ru[None, :] == uu, s_cu.to(tl.float32), 0.0), axis=1)
                if SWAP:
                    d = mma(hi, tl.trans(ao), mma(lo, tl.trans(ae), tl.zeros((BR, SP), dtype=tl.float32)))
                    if FMT != 2:
                        acc += d * fw[:, None] * fa[None, :]
                    else:
                        acc += d * fw[:, None]
                else:
                    d = mma(ao, tl.trans(hi), mma(ae, tl.trans(lo), tl.zeros((SP, BR), dtype=tl.float32)))
                    if FMT != 2:
                        acc += d * fa[:, None] * fw[None, :]
                    else:
                        acc += d * fw[None, :]
    if SWAP:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def k2_exp1_kernel(elist_ptr, nd_ptr, a_ptr, as_ptr, w_ptr, ws_ptr, w_se, w_sr, ws_se, ws_sr, v_ptr, vs_ptr,
                   h_ptr, wsd_ptr, swsd, fin_ptr, S, LAT, RI, H, SI, NCH, DMAX,
                   FMT: tl.constexpr, BR: tl.constexpr, SP: tl.constexpr, UNR: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, BETA: tl.constexpr, LBETA: tl.constexpr, STAG: tl.constexpr,
                   SWAP: tl.constexpr):
    """Grid (DMAX·NCH + cdiv(H, BN),): routed gemm1 + SiTU for (distinct pick i, RI chunk c),
    then the shared-expert down projection sh -> fin (the up projection adds to it later).

    v is kept per pick slot (perm32 order for the quantized formats): mxfp4 quantizes it per
    32 (never rounded to bf16), the other formats round it to bf16. Slots past the number
    of distinct picks return at once.
    """
    pid = tl.program_id(0)
    rs = tl.arange(0, SP)
    sm = (rs < S)[:, None]
    if pid < DMAX * NCH:
        i = pid // NCH
        c = pid % NCH
        if i < tl.load(nd_ptr):
            e = tl.load(elist_ptr + i).to(tl.int64)
            rr = c * BR + tl.arange(0, BR)
            wb = w_ptr + e * w_se
            sb = ws_ptr + e * ws_se
            ko = (pid * STAG) % (LAT // (32 * UNR))
            g = xgemm(wb + rr * w_sr, sb + rr * ws_sr, a_ptr, LAT, as_ptr, LAT // 32, S, LAT, ko, FMT, BR, SP, UNR,
                      SWAP)
            u = xgemm(wb + (RI + rr) * w_sr, sb + (RI + rr) * ws_sr, a_ptr, LAT, as_ptr, LAT // 32, S, LAT, ko, FMT,
                      BR, SP, UNR, SWAP)
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
        n0 = (pid - DMAX * NCH) * BN
        rn = n0 + tl.arange(0, BN)
        nks = SI // BK
        acc = gemv(h_ptr, SI, S, wsd_ptr, swsd, n0, H, 0, nks, (pid * STAG) % nks, BN, BK, SP, False, SWAP)
        tl.store(fin_ptr + rs[:, None] * H + rn[None, :], bf16(acc), mask=sm & (rn < H)[None, :])


@triton.jit
def k2_exp2_kernel(elist_ptr, nd_ptr, ids_ptr, tw_ptr, v_ptr, vs_ptr, w_ptr, ws_ptr, w_se, w_sr, ws_se, ws_sr,
                   contrib_ptr, y_ptr, ctr_ptr, S, LAT, RI, DMAX,
                   FMT: tl.constexpr, BL: tl.constexpr, SP: tl.constexpr, UNR: tl.constexpr,
                   K: tl.constexpr, KP: tl.constexpr, STAG: tl.constexpr, SWAP: tl.constexpr):
    """Grid (NLB·DMAX,): routed gemm2 for (latent block lb, distinct pick i) -> contrib[t, k] =
    bf16(acc·w) for every token t that picked it (at its rank k); the last program of a
    latent block (acq_rel counter) sums y = bf16(y + contrib_k) in pick order for the block.
    """
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
        acc = xgemm(w_ptr + e64 * w_se + rl * w_sr, ws_ptr + e64 * ws_se + rl * ws_sr, v_ptr + i * S * RI, RI,
                    vs_ptr + i * S * (RI // 32), RI // 32, S, RI, ko, FMT, BL, SP, UNR, SWAP)
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
def k2_up_kernel(ls_ptr, lnw_ptr, wup_ptr, swu, fin_ptr, tapln_ptr, part_ptr, ctr_ptr, S, LAT, H, UPN, col0, ln_eps,
                 BN: tl.constexpr, BK: tl.constexpr, SP: tl.constexpr, SPLIT: tl.constexpr, STAG: tl.constexpr,
                 SWAP: tl.constexpr, TAPS: tl.constexpr):
    """Grid (cdiv(UPN, BN)·SPLIT,): Ls = bf16(reduced y), LN = bf16(rmsnorm(Ls)·ln_w), and on
    this rank's columns fin = bf16(sh + LN @ w_up^T). Every program recomputes the row
    norms; with SPLIT > 1 the last program of an output block adds the K-split partials
    in split order."""
    pid = tl.program_id(0)
    nb = pid // SPLIT
    ks = pid % SPLIT
    n0 = nb * BN
    rs = tl.arange(0, SP)
    sm = (rs < S)[:, None]
    rk = tl.arange(0, BK)
    rn = n0 + tl.arange(0, BN)
    ss = tl.zeros((SP,), dtype=tl.float32)
    for k0 in range(0, LAT, BK):
        lv = bf16(tl.load(ls_ptr + rs[:, None] * LAT + k0 + rk[None, :], mask=sm, other=0.0)).to(tl.float32)
        ss += tl.sum(lv * lv, axis=1)
    rstd = rsqrt(ss / LAT + ln_eps)
    if SWAP:
        acc = tl.zeros((BN, SP), dtype=tl.float32)
    else:
        acc = tl.zeros((SP, BN), dtype=tl.float32)
    nk = LAT // BK // SPLIT
    ko = (pid * STAG) % nk
    for it in range(0, nk):
        k0 = (ks * nk + (it + ko) % nk) * BK
        lv = bf16(tl.load(ls_ptr + rs[:, None] * LAT + k0 + rk[None, :], mask=sm, other=0.0)).to(tl.float32)
        ln = bf16(lv * rstd[:, None] * tl.load(lnw_ptr + k0 + rk).to(tl.float32)[None, :])
        if TAPS:
            if nb == 0:
                tl.store(tapln_ptr + rs[:, None] * LAT + k0 + rk[None, :], ln, mask=sm)
        w = tl.load(wup_ptr + rn[:, None] * swu + k0 + rk[None, :], mask=(rn < UPN)[:, None], other=0.0)
        if SWAP:
            acc = mma(w, tl.trans(ln), acc)
        else:
            acc = mma(ln, tl.trans(w), acc)
    if SWAP:
        acc2 = tl.trans(acc)
    else:
        acc2 = acc
    last, tot = splitk(acc2, part_ptr, UPN, ctr_ptr, nb, ks, S, UPN, n0, BN, SP, SPLIT)
    if last:
        fo = fin_ptr + rs[:, None] * H + col0 + rn[None, :]
        om = sm & (rn < UPN)[None, :]
        sh = tl.load(fo, mask=om, other=0.0).to(tl.float32)
        tl.store(fo, bf16(sh + tot), mask=om)
