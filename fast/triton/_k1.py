"""K1 (KDA pre-attention) kernels. Launches: [attnres + in_proj] (one ticketed launch), then
the conv/gates/recurrence/gated-norm launch. docs/triton.md has the plan."""
from __future__ import annotations

import triton
import triton.language as tl

from ._jit import (ares_phases, bf16, gemv, ksum, mma, msq_row, pdl_enter, pdl_trigger, pdl_wait, rsqrt, sigmoid,
                   splitk, stamp, ticket_done, ticket_reset, wait_ge)

# ctr layout of a ticketed launch: [ticket, x chunks ready, programs done, spin overflow, router blocks done
# (K2), -, -, -, phase-A count per row (S), phase-B count per row (S)]. K1's rec_cnt count has its own
# 128-byte line (cnt: [in_proj row blocks stored, recurrence programs past that wait, -, spin overflow]):
# on ctr's line its polls would queue the k1_mid programs' own counter atomics behind them.


@triton.jit
def gemv_kernel(x_ptr, sx, S, w_ptr, sw, out_ptr, so, N, K, part_ptr, ctr_ptr, BN: tl.constexpr, BK: tl.constexpr,
                SP: tl.constexpr, SPLIT: tl.constexpr, STAG: tl.constexpr, SWAP: tl.constexpr,
                PDL: tl.constexpr = False):
    """Grid (cdiv(N, BN)·SPLIT,): out[:S, n0:n0+BN] = bf16(x @ w^T), one rounding after fp32
    accumulation. SPLIT > 1 splits K: partial sums go to part[SPLIT, SP, N] and the last
    program of an output block (acq_rel counter) adds them in split order."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    nb = pid // SPLIT
    ks = pid % SPLIT
    n0 = nb * BN
    nk = K // BK // SPLIT
    acc = gemv(x_ptr, sx, S, w_ptr, sw, n0, N, ks * nk * BK, nk, (pid * STAG) % nk, BN, BK, SP, False, SWAP)
    last, tot = splitk(acc, part_ptr, N, ctr_ptr, nb, ks, S, N, n0, BN, SP, SPLIT)
    if last:
        rs = tl.arange(0, SP)
        rn = n0 + tl.arange(0, BN)
        tl.store(out_ptr + rs[:, None] * so + rn[None, :], bf16(tot), mask=(rs[:, None] < S) & (rn[None, :] < N))


@triton.jit
def k1_mid_kernel(ctr_ptr, prefix_ptr, sp, delta_ptr, sd, blocks_ptr, sbt, sbb, nw_ptr, qk_ptr, inw_ptr, x_ptr,
                  apart_ptr, mix_ptr, msq_ptr, w_ptr, sw, proj_ptr, part_ptr, ctrn_ptr, S, H, HC, CH, NP, eps, out_eps,
                  spin, NB: tl.constexpr, NBP: tl.constexpr, CHP: tl.constexpr, BHC: tl.constexpr,
                  ADD: tl.constexpr, WRITE_IDX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SP: tl.constexpr,
                  SPLIT: tl.constexpr, STAG: tl.constexpr, SWAP: tl.constexpr, TP: tl.constexpr,
                  PDL: tl.constexpr = False, TRIG: tl.constexpr = False, XC: tl.constexpr = False, tl_ptr=None,
                  TL: tl.constexpr = False, LD: tl.constexpr = False, cnt_ptr=None, CNT: tl.constexpr = False,
                  NAP: tl.constexpr = 0, PART: tl.constexpr = False, RST: tl.constexpr = False):
    """Grid (3·S·CH + cdiv(NP, BN)·SPLIT,): steps 1-4 in one launch.

    Programs take a ticket (their start order). Tickets < 3·S·CH run the AttnRes phases of
    (row, column chunk) (_jit.ares_phases); the others wait until all S·CH x chunks are
    published, then stream one K split of one in_proj row block. Every wait is on programs
    with earlier tickets, so it ends (also on ROCm, also in the interpreter, which runs
    programs in order). The last program resets the counters.
    CNT: each in_proj row block, once stored, raises cnt[0] (release) for k1_rec's wait.
    PART: in_proj's K-split partials are only stored; k1_rec sums them (_pj), so no program waits
    on a split handshake and proj is not written. RST: no program counts itself done; k1_rec
    resets the counters once this launch has completed (the last in_proj program then exits
    right after its stores).
    """
    pdl_enter(PDL)
    pdl_trigger(TRIG)
    ticket = tl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
    stamp(tl_ptr, ticket * 4, TL)
    NA3 = (2 if XC else 3) * S * CH
    if ticket < NA3:
        ares_phases(ticket, ctr_ptr, S, spin, prefix_ptr, sp, delta_ptr, sd, blocks_ptr, sbt, sbb, nw_ptr, qk_ptr,
                    inw_ptr, x_ptr, x_ptr, apart_ptr, mix_ptr, msq_ptr, H, HC, CH, eps, out_eps, NB, NBP, CHP, BHC,
                    ADD, WRITE_IDX, False, XC, LD, NAP)
        stamp(tl_ptr, ticket * 4 + 1, TL)
    else:
        u = ticket - NA3
        nb = u // SPLIT
        ks = u % SPLIT
        n0 = nb * BN
        wait_ge(ctr_ptr + 1, S * CH, spin, ctr_ptr + 3, LD, NAP)
        stamp(tl_ptr, ticket * 4 + 1, TL)
        nk = H // BK // SPLIT
        if XC:  # the rows' input-norm factors (phase C's), then x normalized per block in the stream
            rs = tl.arange(0, SP)
            xr = rsqrt(msq_row(msq_ptr, rs, rs < S, CH, CHP) / H + out_eps)
            acc = gemv(mix_ptr, H, S, w_ptr, sw, n0, NP, ks * nk * BK, nk, (ticket * STAG) % nk, BN, BK, SP, True,
                       SWAP, True, xr, inw_ptr, x_ptr, tl.where(nb == 0, 1, 0))
        else:
            acc = gemv(x_ptr, H, S, w_ptr, sw, n0, NP, ks * nk * BK, nk, (ticket * STAG) % nk, BN, BK, SP, True, SWAP)
        last, tot = splitk(acc, part_ptr, NP, ctrn_ptr, nb, ks, S, NP, n0, BN, SP, SPLIT, not PART)
        if last:
            rs = tl.arange(0, SP)
            rn = n0 + tl.arange(0, BN)
            tl.store(proj_ptr + rs[:, None] * NP + rn[None, :], bf16(tot),
                     mask=(rs[:, None] < S) & (rn[None, :] < NP))
            if CNT:
                tl.debug_barrier()
                tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    stamp(tl_ptr, ticket * 4 + 2, TL)
    if not RST:
        ticket_done(ctr_ptr, NA3 + tl.cdiv(NP, BN) * SPLIT, S, TP)


@triton.jit
def _pj(proj_ptr, off, mask, ppl, PS: tl.constexpr):
    """in_proj values (bf16) at off of [S, NP]: as k1_mid stored them (PS 0), or summed here from its
    PS K-split partials (fp32 planes ppl apart at proj_ptr, k1_mid PART) and rounded once: the bits
    k1_mid's last split program would have stored."""
    if PS:
        return bf16(ksum(proj_ptr, off, mask, ppl, PS))
    elif mask is None:
        return tl.load(proj_ptr + off)
    else:
        return tl.load(proj_ptr + off, mask=mask, other=0.0)


@triton.jit
def k1_proj_kernel(part_ptr, ppl, proj_ptr, S, NP, PS: tl.constexpr, SP: tl.constexpr, BN: tl.constexpr):
    """Grid (cdiv(NP, BN),): proj[:S, n0:n0+BN] = _pj of k1_mid's K-split partials, for the taps of
    a PART launch (the recurrence sums the same partials itself)."""
    rs = tl.arange(0, SP)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    m = (rs[:, None] < S) & (rn[None, :] < NP)
    off = rs[:, None] * NP + rn[None, :]
    tl.store(proj_ptr + off, _pj(part_ptr, off, m, ppl, PS), mask=m)


@triton.jit
def _seq(POS: tl.constexpr, W: tl.constexpr, c, csb, csc, csp, a, proj_ptr, spj, row0, ppl, PS: tl.constexpr):
    """seq[POS] of channels c (fp32): window entry POS of the conv state, then the new in_proj rows."""
    if POS < W - 1:
        v = tl.load(csb + c * csc + (a - 1 + POS) * csp)
    else:
        v = _pj(proj_ptr, (row0 + POS - (W - 1)) * spj + c, None, ppl, PS)
    return v.to(tl.float32)


@triton.jit
def _conv_y(j: tl.constexpr, W: tl.constexpr, c, cw_ptr, scw, csb, csc, csp, a, proj_ptr, spj, row0, ppl,
            PS: tl.constexpr):
    """bf16(silu(Σ_q conv_w[c, q]·seq[j+q])) as fp32 values. Each product rounds to fp32 (inexact for an
    fp32 conv_w), then the sum in q order: the launch is compiled without FMA contraction."""
    y = tl.zeros(c.shape, dtype=tl.float32)
    for q in tl.static_range(W):
        y += tl.load(cw_ptr + c * scw + q).to(tl.float32) * _seq(j + q, W, c, csb, csc, csp, a, proj_ptr, spj, row0,
                                                                 ppl, PS)
    return bf16(y / (1.0 + tl.exp(-y))).to(tl.float32)


@triton.jit
def _conv_qkv(j: tl.constexpr, W: tl.constexpr, cq, ck, cv, cw_ptr, scw, csb, csc, csp, a, proj_ptr, spj, row0, ppl,
              PS: tl.constexpr):
    """(q, k, v) conv outputs of token j (_conv_y of the head's q/k channels and the program's v rows)."""
    return (_conv_y(j, W, cq, cw_ptr, scw, csb, csc, csp, a, proj_ptr, spj, row0, ppl, PS),
            _conv_y(j, W, ck, cw_ptr, scw, csb, csc, csp, a, proj_ptr, spj, row0, ppl, PS),
            _conv_y(j, W, cv, cw_ptr, scw, csb, csc, csp, a, proj_ptr, spj, row0, ppl, PS))


@triton.jit
def _gate_of(j: tl.constexpr, gate_all, rl, GT: tl.constexpr):
    """Token j's gate ([HD]) out of gate_all ([HD, LP] if GT, else [LP, HD])."""
    if GT:
        return tl.sum(tl.where((rl == j)[None, :], gate_all, 0.0), axis=1)
    else:
        return tl.sum(tl.where((rl == j)[:, None], gate_all, 0.0), axis=0)


@triton.jit
def _norm_o(t, obuf_ptr, h, kk, P: tl.constexpr, HD: tl.constexpr):
    """The gated norm's o of token row t (fp32; written by the head's other programs: read past L1)."""
    return tl.load(obuf_ptr + t * P + h * HD + kk, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _norm_g(t, proj_ptr, spj, h, kk, P: tl.constexpr, HD: tl.constexpr, ppl, PS: tl.constexpr):
    """The gated norm's g2 in_proj row of token row t (fp32)."""
    return _pj(proj_ptr, t * spj + 3 * P + h * HD + kk, None, ppl, PS).to(tl.float32)


@triton.jit
def _carry_load(c, csb, csc, csp, a, proj_ptr, spj, row0, W: tl.constexpr, L: tl.constexpr, SEQP: tl.constexpr,
                CT: tl.constexpr, ppl, PS: tl.constexpr):
    """seq[1:W-1+L] of channels c (bf16 as stored), the new conv window: [channels, SEQP] if CT, else
    [SEQP, channels]."""
    rp = tl.arange(0, SEQP)
    src = rp + 1
    keep = rp < W - 2 + L
    inwin = src < W - 1
    if CT:
        v1 = tl.load(csb + c[:, None] * csc + (a - 1 + src)[None, :] * csp, mask=(inwin & keep)[None, :], other=0.0)
        v2 = _pj(proj_ptr, (row0 + src - (W - 1))[None, :] * spj + c[:, None], (keep & (src >= W - 1))[None, :], ppl,
                 PS)
        return tl.where(inwin[None, :], v1, v2)
    else:
        v1 = tl.load(csb + c[None, :] * csc + (a - 1 + src)[:, None] * csp, mask=(inwin & keep)[:, None], other=0.0)
        v2 = _pj(proj_ptr, (row0 + src - (W - 1))[:, None] * spj + c[None, :], (keep & (src >= W - 1))[:, None], ppl,
                 PS)
        return tl.where(inwin[:, None], v1, v2)


@triton.jit
def _carry_store(val, c, csb, csc, csp, do_write, W: tl.constexpr, L: tl.constexpr, SEQP: tl.constexpr,
                 CT: tl.constexpr):
    """conv_state[slot, c, 0:W-2+L] = val (_carry_load, exact copies), after a barrier: every read of the
    window by this program's threads precedes the writes."""
    rp = tl.arange(0, SEQP)
    tl.debug_barrier()
    if CT:
        tl.store(csb + c[:, None] * csc + rp[None, :] * csp, val,
                 mask=tl.where(do_write, (rp < W - 2 + L)[None, :], False))
    else:
        tl.store(csb + c[None, :] * csc + rp[:, None] * csp, val,
                 mask=tl.where(do_write, (rp < W - 2 + L)[:, None], False))


@triton.jit
def _beta_all(proj_ptr, spj, row0, rl, h, P: tl.constexpr, RANK: tl.constexpr, L: tl.constexpr, ppl, PS: tl.constexpr):
    """beta of the request's L tokens ([LP], fp32)."""
    return sigmoid(_pj(proj_ptr, (row0 + rl) * spj + 4 * P + RANK + h, rl < L, ppl, PS).to(tl.float32))


@triton.jit
def _hoist_rows(cq, ck, csb, csc, csp, a, proj_ptr, spj, row0, h, kk, W: tl.constexpr, L: tl.constexpr,
                SEQP: tl.constexpr, CT: tl.constexpr, P: tl.constexpr, HD: tl.constexpr, ppl, PS: tl.constexpr):
    """What the head's last program needs after the counter (the q/k windows, the gated norm's g2 rows),
    loaded before the chain's stores (HOIST)."""
    carry_q = _carry_load(cq, csb, csc, csp, a, proj_ptr, spj, row0, W, L, SEQP, CT, ppl, PS)
    carry_k = _carry_load(ck, csb, csc, csp, a, proj_ptr, spj, row0, W, L, SEQP, CT, ppl, PS)
    g2s = ()
    for j in tl.static_range(L):
        g2s = g2s + (_norm_g(row0 + j, proj_ptr, spj, h, kk, P, HD, ppl, PS),)
    return carry_q, carry_k, g2s


@triton.jit
def _chain_flat(st, live, cq, ck, cv, vv, kk, rl, gate_all, r, h, row0, a, slots, proj_ptr, spj, cw_ptr, scw, csb,
                csc, csp, rbase, rss, full, st_ptr, str_, stj, obuf_ptr, tconv_ptr, tgate_ptr, tbeta_ptr,
                L: tl.constexpr, W: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr, RANK: tl.constexpr,
                BV: tl.constexpr, LP: tl.constexpr, TAPS: tl.constexpr, GT: tl.constexpr, ppl, PS: tl.constexpr):
    """The token chain with everything that does not depend on the state computed first, per token
    (tuples): q/k conv outputs as [BV, HD] tiles in the state's layout (every row the same
    channels; their norms reduce within a warp), v, decay, beta and the state slot. The chain is
    then the state update alone, with no layout change of a vector per token."""
    P: tl.constexpr = NH * HD
    zr = tl.zeros((BV, 1), dtype=tl.int32)
    cq2 = zr + cq[None, :]
    ck2 = zr + ck[None, :]
    zb = tl.zeros((BV, HD), dtype=tl.bfloat16)
    qs = ()
    ks = ()
    vs = ()
    bs = ()
    ss = ()
    for j in tl.static_range(L):
        t = row0 + j
        qc, kc, vc = _conv_qkv(j, W, cq, ck, cv, cw_ptr, scw, csb, csc, csp, a, proj_ptr, spj, row0, ppl, PS)
        beta = sigmoid(_pj(proj_ptr, t * spj + 4 * P + RANK + h, None, ppl, PS).to(tl.float32))
        qs = qs + ((zb + qc.to(tl.bfloat16)[None, :]),)  # exact: the conv outputs are bf16 values
        ks = ks + ((zb + kc.to(tl.bfloat16)[None, :]),)
        vs = vs + (vc,)
        bs = bs + (beta,)
        ss = ss + (tl.load(st_ptr + r * str_ + j * stj),)
        if TAPS:
            tl.store(tconv_ptr + t * (3 * P) + cv, vc.to(tl.bfloat16))
            if tl.program_id(2) == 0:
                tl.store(tconv_ptr + t * (3 * P) + cq, qc.to(tl.bfloat16))
                tl.store(tconv_ptr + t * (3 * P) + ck, kc.to(tl.bfloat16))
                tl.store(tgate_ptr + t * P + h * HD + kk, _gate_of(j, gate_all, rl, GT))
                tl.store(tbeta_ptr + t * NH + h, beta)
    ob = tl.zeros((BV, LP), dtype=tl.float32)
    for j in tl.static_range(L):
        decay = tl.exp(_gate_of(j, gate_all, rl, GT))
        qc = qs[j].to(tl.float32)
        kc = ks[j].to(tl.float32)
        qn = qc * rsqrt(tl.sum(qc * qc, axis=1) + 1e-6)[:, None] * (HD ** -0.5)
        kn = kc * rsqrt(tl.sum(kc * kc, axis=1) + 1e-6)[:, None]
        st = st * decay[None, :]
        pred = tl.sum(st * kn, axis=1)
        u = (vs[j] - pred) * bs[j]
        st = st + u[:, None] * kn
        o = bf16(tl.sum(st * qn, axis=1))
        ob = tl.where((rl == j)[None, :], tl.where(live, o, 0.0).to(tl.float32)[:, None], ob)
        slot = ss[j]
        tl.store(rbase + tl.maximum(slot, 0).to(tl.int64) * rss, st, mask=tl.where(live & (slot > 0), full, False))
    tl.store(obuf_ptr + (row0 + rl)[None, :] * P + h * HD + vv[:, None], ob.to(tl.bfloat16),
             mask=(vv >= 0)[:, None] & (rl < L)[None, :])


@triton.jit
def k1_rec_kernel(proj_ptr, spj, cw_ptr, scw, cs_ptr, css, csc, csp, wfb_ptr, sfb, alog_ptr, dtb_ptr, onw_ptr,
                  rs_ptr, rss, rsh, rsv, rsk, st_ptr, str_, stj, na_ptr, core_ptr, sco, obuf_ptr, ctr_ptr,
                  tconv_ptr, tgate_ptr, tbeta_ptr, lower_bound, onorm_eps,
                  L: tl.constexpr, W: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr, RANK: tl.constexpr,
                  BV: tl.constexpr, NV: tl.constexpr, SEQP: tl.constexpr, LP: tl.constexpr, TAPS: tl.constexpr,
                  GT: tl.constexpr = False, FLAT: tl.constexpr = False, PDL: tl.constexpr = False,
                  PRE: tl.constexpr = False, LEAN: tl.constexpr = False, HOIST: tl.constexpr = False,
                  CT: tl.constexpr = False, tl_ptr=None,
                  TL: tl.constexpr = False, cnt_ptr=None, nblk=0, spin=0, CNT: tl.constexpr = False,
                  LD: tl.constexpr = False, NAP: tl.constexpr = 0, ppl=0, PS: tl.constexpr = 0, mctr_ptr=None,
                  S=0, TPM: tl.constexpr = 1, RST: tl.constexpr = False):
    """Grid (R, NH, NV): steps 5-8 for request r, head h, value rows [vb·BV, (vb+1)·BV).

    Each program owns its v rows of the state and of the v conv channels. The q/k conv
    channels and the gated norm belong to the head, so the last of the NV programs of
    (r, h) to finish (an acq_rel counter) writes the q/k window carry and core_out.
    PRE (a programmatic dependent of k1_mid): what k1_mid does not write (slots, the state
    tile, w_fb, A_log, dt_bias) is loaded before the wait for k1_mid's in_proj rows.
    HOIST: the conv outputs of all L tokens before the chain, the gated norm's g2 rows and the
    q/k windows before the chain's first store, its o rows before its own first store (a load
    after a store of the same kernel cannot move above it, so otherwise each token pays an L2
    round trip in turn).
    CT: the conv windows as [channels, positions] tiles. As [positions, channels] at SEQP = BV
    they have the state tile's shape, Triton gives the state their 16-byte bf16 layout, and every
    token's state store then converts the tile through shared memory (sm_90, L = 4, BV = 8).
    CNT: the wait for the in_proj rows is a poll of k1_mid's count of stored row blocks (cnt[0]
    reaching nblk), not the grid dependency's completion and flush; the last program past the
    poll resets cnt[0:2] (k1_mid's own reset could precede a late poll). Every k1_mid program has
    started before a dependent program does (k1_mid triggers at its start), so the poll ends.
    With PRE the grid wait moves to the end: this launch completes after k1_mid, as the next
    launch's wait on it assumes.
    PS > 0 (k1_mid PART): proj_ptr holds k1_mid's PS K-split partials (planes ppl apart), summed
    where they are read (_pj). RST (k1_mid RST): program (0, 0, 0), at its end, resets k1_mid's
    S-row counters at mctr_ptr (ticket_reset).
    """
    if not PRE:
        pdl_enter(PDL)
    r = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    tli = ((r * NH + h) * NV + vb) * 4
    stamp(tl_ptr, tli, TL)
    P: tl.constexpr = NH * HD
    # the request's slots in one load beside num_acc's (a dependent load costs a round trip)
    rl = tl.arange(0, LP)
    a = tl.load(na_ptr + r)
    slots = tl.load(st_ptr + r * str_ + rl * stj, mask=rl < L, other=0)
    sc = tl.sum(tl.where(rl == 0, slots, 0), axis=0)
    s0 = tl.sum(tl.where(rl == a - 1, slots, 0), axis=0)
    live = s0 > 0
    kk = tl.arange(0, HD)
    vv = vb * BV + tl.arange(0, BV)
    cq = h * HD + kk
    ck = P + h * HD + kk
    cv = 2 * P + h * HD + vv
    csb = cs_ptr + tl.maximum(sc, 0).to(tl.int64) * css  # a null conv slot reads slot 0
    row0 = r * L
    rbase = rs_ptr + h * rsh + vv[:, None] * rsv + kk[None, :] * rsk
    full = (vv[:, None] >= 0) & (kk[None, :] >= 0)
    st = tl.load(rbase + tl.maximum(s0, 0).to(tl.int64) * rss, mask=tl.where(live, full, False), other=0.0)  # S[v, k]
    ri = tl.arange(0, RANK)
    A = tl.exp(tl.load(alog_ptr + h))
    if GT:
        wfb = tl.load(wfb_ptr + (h * HD + kk)[:, None] * sfb + ri[None, :])  # [HD(k), RANK]
        dtb = tl.load(dtb_ptr + h * HD + kk)[:, None]
    else:
        wfb = tl.load(wfb_ptr + (h * HD + kk)[None, :] * sfb + ri[:, None])  # [RANK, HD(k)]
        dtb = tl.load(dtb_ptr + h * HD + kk)[None, :]
    if CNT:
        wait_ge(cnt_ptr, nblk, spin, cnt_ptr + 3, LD, NAP)
        if tl.atomic_add(cnt_ptr + 1, 1, sem="relaxed", scope="gpu") == tl.num_programs(0) * NH * NV - 1:
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(cnt_ptr + 1, 0, sem="relaxed", scope="gpu")
    else:
        pdl_wait(PRE)
    stamp(tl_ptr, tli + 1, TL)
    carry_v = _carry_load(cv, csb, csc, csp, a, proj_ptr, spj, row0, W, L, SEQP, CT, ppl, PS)  # before the chain: no wait after it
    # gates of all L tokens at once: g1 = bf16(f_a @ w_fb[head]^T) as one small MMA
    if GT:  # [HD, LP]: the MMA's layout stays off the state (its [LP, HD] form made the state change layout per token)
        fat = _pj(proj_ptr, (row0 + rl)[None, :] * spj + 4 * P + ri[:, None], (rl < L)[None, :], ppl, PS)
        g1 = bf16(mma(wfb, fat, tl.zeros((HD, LP), dtype=tl.float32))).to(tl.float32)
        gate_all = lower_bound * sigmoid(A * (g1 + dtb))  # [HD, LP]
    else:
        fa = _pj(proj_ptr, (row0 + rl)[:, None] * spj + 4 * P + ri[None, :], (rl < L)[:, None], ppl, PS)
        g1 = bf16(mma(fa, wfb, tl.zeros((LP, HD), dtype=tl.float32))).to(tl.float32)
        gate_all = lower_bound * sigmoid(A * (g1 + dtb))  # [LP, HD]
    beta_all = _beta_all(proj_ptr, spj, row0, rl, h, P, RANK, L, ppl, PS)
    if HOIST:
        carry_q, carry_k, g2s = _hoist_rows(cq, ck, csb, csc, csp, a, proj_ptr, spj, row0, h, kk, W, L, SEQP, CT,
                                            P, HD, ppl, PS)
    if FLAT:
        _chain_flat(st, live, cq, ck, cv, vv, kk, rl, gate_all, r, h, row0, a, slots, proj_ptr, spj, cw_ptr, scw,
                    csb, csc, csp, rbase, rss, full, st_ptr, str_, stj, obuf_ptr, tconv_ptr, tgate_ptr, tbeta_ptr,
                    L, W, NH, HD, RANK, BV, LP, TAPS, GT, ppl, PS)
    ob = tl.zeros((BV, LP), dtype=tl.float32)
    convs = ()
    for j in tl.static_range(L if HOIST and not FLAT else 0):
        convs = convs + (_conv_qkv(j, W, cq, ck, cv, cw_ptr, scw, csb, csc, csp, a, proj_ptr, spj, row0, ppl, PS),)
    for j in tl.static_range(0 if FLAT else L):
        t = row0 + j
        if HOIST:
            qc, kc, vc = convs[j]
        else:
            qc, kc, vc = _conv_qkv(j, W, cq, ck, cv, cw_ptr, scw, csb, csc, csp, a, proj_ptr, spj, row0, ppl, PS)
        gate = _gate_of(j, gate_all, rl, GT)
        decay = tl.exp(gate)
        beta = tl.sum(tl.where(rl == j, beta_all, 0.0), axis=0)
        # l2-normalized q, k in fp32 (not rounded)
        if LEAN:  # as [1, HD] rows of the state's layout: the norms reduce without a layout change
            q2 = qc[None, :]
            k2 = kc[None, :]
            qn = q2 * (rsqrt(tl.sum(q2 * q2, axis=1) + 1e-6) * (HD ** -0.5))[:, None]
            kn = k2 * rsqrt(tl.sum(k2 * k2, axis=1) + 1e-6)[:, None]
        else:
            qn = (qc * rsqrt(tl.sum(qc * qc, axis=0) + 1e-6) * (HD ** -0.5))[None, :]
            kn = (kc * rsqrt(tl.sum(kc * kc, axis=0) + 1e-6))[None, :]
        st = st * decay[None, :]
        pred = tl.sum(st * kn, axis=1)
        u = (vc - pred) * beta
        st = st + u[:, None] * kn
        o = tl.where(live, bf16(tl.sum(st * qn, axis=1)), 0.0)
        if LEAN:  # o gathered per token column, stored once after the chain
            ob = tl.where((rl == j)[None, :], o.to(tl.float32)[:, None], ob)
        else:
            tl.store(obuf_ptr + t * P + h * HD + vv, o)
        slot = tl.sum(tl.where(rl == j, slots, 0), axis=0)
        tl.store(rbase + tl.maximum(slot, 0).to(tl.int64) * rss, st, mask=tl.where(live & (slot > 0), full, False))
        if TAPS:
            tl.store(tconv_ptr + t * (3 * P) + cv, vc.to(tl.bfloat16))
            if vb == 0:
                tl.store(tconv_ptr + t * (3 * P) + cq, qc.to(tl.bfloat16))
                tl.store(tconv_ptr + t * (3 * P) + ck, kc.to(tl.bfloat16))
                tl.store(tgate_ptr + t * P + h * HD + kk, gate)
                tl.store(tbeta_ptr + t * NH + h, beta)
    if LEAN and not FLAT:
        tl.store(obuf_ptr + (row0 + rl)[None, :] * P + h * HD + vv[:, None], ob.to(tl.bfloat16),
                 mask=(vv >= 0)[:, None] & (rl < L)[None, :])
    stamp(tl_ptr, tli + 2, TL)
    _carry_store(carry_v, cv, csb, csc, csp, sc > 0, W, L, SEQP, CT)
    if NV > 1:
        tl.debug_barrier()
        last = tl.atomic_add(ctr_ptr + r * NH + h, 1, sem="acq_rel", scope="gpu") == NV - 1
    else:
        last = True
    if last:
        if NV > 1:
            tl.atomic_xchg(ctr_ptr + r * NH + h, 0, sem="relaxed", scope="gpu")
            tl.debug_barrier()
        if not HOIST:  # the q/k windows' loads in flight with the gated norm's; stored after it
            carry_q = _carry_load(cq, csb, csc, csp, a, proj_ptr, spj, row0, W, L, SEQP, CT, ppl, PS)
            carry_k = _carry_load(ck, csb, csc, csp, a, proj_ptr, spj, row0, W, L, SEQP, CT, ppl, PS)
        onw = tl.load(onw_ptr + kk).to(tl.float32)
        ohs = ()
        for j in tl.static_range(L if HOIST else 0):
            ohs = ohs + (_norm_o(row0 + j, obuf_ptr, h, kk, P, HD),)
        for j in tl.static_range(L):
            t = row0 + j
            if HOIST:
                oh = ohs[j]
                g2 = g2s[j]
            else:
                oh = _norm_o(t, obuf_ptr, h, kk, P, HD)
                g2 = _norm_g(t, proj_ptr, spj, h, kk, P, HD, ppl, PS)
            y = oh * rsqrt(tl.sum(oh * oh, axis=0) / HD + onorm_eps) * onw * sigmoid(g2)
            tl.store(core_ptr + t * sco + h * HD + kk, bf16(y))
        _carry_store(carry_q, cq, csb, csc, csp, sc > 0, W, L, SEQP, CT)
        _carry_store(carry_k, ck, csb, csc, csp, sc > 0, W, L, SEQP, CT)
    if CNT:
        pdl_wait(PRE)
    if RST:  # at the end, where few registers are live (k1_mid completed before the wait above)
        if (r == 0) & (h == 0) & (vb == 0):
            ticket_reset(mctr_ptr, S, TPM)
    stamp(tl_ptr, tli + 3, TL)
