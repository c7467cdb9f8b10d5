"""Triton device functions shared by the K1 and K2 kernels.

Portable Triton (no vendor libdevice): the same source runs on CUDA, on ROCm, and in the
CPU interpreter (`TRITON_INTERPRET=1`, read once at import). One exception, chosen by the
host per launch: on NVIDIA the E2M1 nibble decode may be inline PTX (`e2m1_f16x2_ptx`, the
same bits as `e2m1_f16x2`, checked on the device by tests/test_triton_nibble.py), and the
kernels may be launched as programmatic dependents (`pdl_enter`).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, globaltimer
    HAS_GDC = True
except ImportError:  # a Triton without grid dependency control: the host never sets PDL or timeline stamps
    HAS_GDC = False

INTERP = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
SPIN_LIMIT = tl.constexpr(1 << 22)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of every kernel. With PDL (NVIDIA, launched with launch_pdl) this
    kernel's programs may start before the previous kernel in the stream has finished: wait
    until it has and its writes are visible; with PDL == 1 then let the next kernel's programs
    start at once, with PDL == 2 as this kernel's programs exit (they wait here in turn, so no
    program touches memory before every earlier kernel is done)."""
    if PDL:
        gdc_wait()
        if PDL == 1:
            gdc_launch_dependents()


@triton.jit
def pdl_trigger(ON: tl.constexpr):
    """Let the next kernel in the stream (a programmatic dependent) start its programs now."""
    if ON:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(ON: tl.constexpr):
    """A programmatic dependent's wait for the previous kernel (its writes visible after it)."""
    if ON:
        gdc_wait()


@triton.jit
def stamp(tl_ptr, i, ON: tl.constexpr):
    """Timeline builds (NVIDIA): tl_ptr[i] = %globaltimer (ns); tl_ptr may be None when off."""
    if ON:
        tl.store(tl_ptr + i, globaltimer())


@triton.jit
def nap(ns, NAP: tl.constexpr):
    """NVIDIA, NAP > 0: the warp sleeps for about ns nanoseconds (nanosleep: 0..2·ns); returns 0."""
    if NAP > 0:
        return tl.inline_asm_elementwise(asm="nanosleep.u32 $1;\n\tmov.b32 $0, 0;", constraints="=r,r", args=[ns],
                                         dtype=tl.int32, is_pure=False, pack=1)
    else:
        return 0


@triton.jit
def wait_ge(cnt_ptr, target, spin, flag_ptr, LD: tl.constexpr = False, NAP: tl.constexpr = 0):
    """Spin (acquire) until *cnt_ptr >= target: a count that only programs with earlier tickets
    raise, so the wait ends on any GPU and in the interpreter (programs in order). After `spin`
    polls it gives up and raises the overflow flag *flag_ptr (read by the backend's health()).
    LD: the polls are volatile loads, and one acquire read-modify-write follows them, so the
    waiting programs leave the counter's atomic unit to the programs that raise it.
    NAP (NVIDIA): a sleep of about NAP ns after each unmet poll, so hundreds of waiting programs
    do not keep the counter's line busy while the programs they wait for raise it."""
    spins = 0
    if LD:
        while (tl.load(cnt_ptr, volatile=True) < target) & (spins < spin):
            spins += 1 + nap(NAP + spins * 0, NAP)
    else:
        while (tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") < target) & (spins < spin):
            spins += 1 + nap(NAP + spins * 0, NAP)
    if tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") < target:
        tl.atomic_add(flag_ptr, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def bf16(x):
    """fp32 -> bf16, round to nearest even. Devices convert natively; the interpreter's
    own cast truncates, so there the rounding is done on the bits."""
    if INTERP:
        b = x.to(tl.uint32, bitcast=True)
        r = b + 0x7FFF + ((b >> 16) & 1)
        r = tl.where(x != x, b | 0x400000, r)
        return (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def mma(a, b, acc):
    """acc + a @ b, fp32 accumulation of exact bf16/fp16 products. The interpreter's dot
    multiplies bf16 bit patterns as integers, so it gets exact fp32 copies instead."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def rsqrt(x):
    """1/sqrt(x) with both steps correctly rounded (what torch.rsqrt gives on a CPU)."""
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), tl.sqrt_rn(x))


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    """tanh in fp32: odd Taylor polynomial below |x| = 1/8 (no cancellation), else via exp."""
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    x2 = x * x
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    r = tl.where(ax < 0.125, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def situ(g, u, BETA: tl.constexpr, LBETA: tl.constexpr):
    """SiTU(g, u) = β·tanh(g/β)·sigmoid(g) · λ·tanh(u/λ), fp32, same operation order as the reference."""
    return BETA * tanh(g / BETA) * sigmoid(g) * (LBETA * tanh(u / LBETA))


@triton.jit
def pow2(e):
    """2^e as fp32 for int32 e in [-126, 127] (built from the exponent bits: exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e8m0(s):
    """E8M0 scale bytes -> 2^(s-127) (0xFF is NaN; code 0 reads as 0, 2^-127 being below fp32 normals)."""
    si = s.to(tl.int32)
    v = (si << 23).to(tl.float32, bitcast=True)
    return tl.where(si == 255, float("nan"), v)


@triton.jit
def e2m1_f16x2(b):
    """Packed E2M1 bytes -> (low, high nibble) as fp16 holding value·2^-14, exactly.

    The 3 exponent/mantissa bits of a code land in fp16 bits 11..9, so code 1 (0.5) is
    the fp16 subnormal 2^-15 and every other code a normal: two ANDs, two shifts, an OR."""
    w = b.to(tl.uint16)
    lo = ((w & 0x7) << 9) | ((w & 0x8) << 12)
    hi = ((w & 0x70) << 5) | ((w & 0x80) << 8)
    return lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)


@triton.jit
def e2m1_f16x2_ptx(b):
    """e2m1_f16x2 as PTX on 4 packed bytes per instance: both nibble planes' fp16 high bytes
    (em bits to 1..3, sign to 7) in 7 ALU ops, then spread into fp16 pairs by 4 byte permutes:
    ~3 ops per byte instead of ~9. NVIDIA only (not in the interpreter)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 l, h, t;
        shl.b32 t, $4, 1;
        and.b32 l, t, 0x0E0E0E0E;
        shl.b32 t, $4, 4;
        and.b32 t, t, 0x80808080;
        or.b32 l, l, t;
        shr.u32 t, $4, 3;
        and.b32 h, t, 0x0E0E0E0E;
        and.b32 t, $4, 0x80808080;
        or.b32 h, h, t;
        prmt.b32 $0, l, 0, 0x1404;
        prmt.b32 $1, l, 0, 0x3424;
        prmt.b32 $2, h, 0, 0x1404;
        prmt.b32 $3, h, 0, 0x3424;
        }""",
        constraints="=r,=r,=r,=r,r", args=[b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def int4_bf16x2(b):
    """Packed unsigned int4 bytes -> (low, high nibble) as bf16 values u-8 (exact)."""
    w = b.to(tl.uint16)
    lo = ((w & 0xF) | 0x4300).to(tl.bfloat16, bitcast=True).to(tl.float32) - 136.0
    hi = ((w >> 4) | 0x4300).to(tl.bfloat16, bitcast=True).to(tl.float32) - 136.0
    return lo.to(tl.bfloat16), hi.to(tl.bfloat16)


@triton.jit
def mx_code(amax):
    """E8M0 code of the power-of-two ceiling of amax/6 (DESIGN §7), clamped to <= 254."""
    v = amax * 0.16666666666666666  # rounds to fp32 once, as the reference does
    bits = v.to(tl.int32, bitcast=True)
    code = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(code, 254)


@triton.jit
def e2m1_round(y):
    """Round to the nearest E2M1 value, ties to the even code, saturating at ±6 (sign kept)."""
    a = tl.abs(y)
    m = tl.where(a > 5.0, 6.0, tl.where(a >= 3.5, 4.0, tl.where(a > 2.5, 3.0, tl.where(
        a >= 1.75, 2.0, tl.where(a > 1.25, 1.5, tl.where(a >= 0.75, 1.0, tl.where(a > 0.25, 0.5, 0.0)))))))
    return tl.where(y < 0, -m, m)


@triton.jit
def _mx_quant_rows(v, SP: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr):
    """MX fake-quant of v [SP, BN] per 32 columns -> (element values [SP, BN] fp32 with the scale
    taken out: E4M3 if FP8 else E2M1, E8M0 scale codes [SP, BN/32] int32)."""
    G: tl.constexpr = BN // 32
    grp = tl.arange(0, BN) // 32
    rg = tl.arange(0, G)
    av = tl.abs(v)
    inv = tl.zeros((SP, BN), dtype=tl.float32)
    codes = tl.zeros((SP, G), dtype=tl.int32)
    for g in tl.static_range(G):
        amax = tl.max(tl.where((grp == g)[None, :], av, 0.0), axis=1)  # [SP]
        if FP8:
            code = mx8_code(amax)
        else:
            code = mx_code(amax)
        # 2^(127-code): an exact power of two (FP4: code 254 only for amax >= 6·2^126, read as 0;
        # FP8: code <= 246 for any fp32 amax)
        inv = tl.where((grp == g)[None, :], ((254 - code) << 23).to(tl.float32, bitcast=True)[:, None], inv)
        codes = tl.where((rg == g)[None, :], code[:, None], codes)
    if FP8:
        q = e4m3_round(v * inv)
    else:
        q = e2m1_round(v * inv)
    return q, codes


@triton.jit
def mx_quant_rows(v, SP: tl.constexpr, BN: tl.constexpr):
    """MXFP4 fake-quant of v [SP, BN] per 32 columns (ref.quant.mx_fake_quant)."""
    return _mx_quant_rows(v, SP, BN, False)


@triton.jit
def mx8_code(amax):
    """E8M0 code of an MXFP8 (E4M3) block (OCP MX: floor(log2(amax)) - 8, clamped to [0, 254]),
    read off amax's fp32 exponent field as ref.quant.mx8_scale_code does."""
    ef = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.minimum(tl.maximum(ef - 8, 0), 254)


@triton.jit
def e4m3_round(y):
    """Nearest FP8 E4M3 (fn) value of fp32 y, ties to even, saturating at ±448. The quantum
    2^(max(e, -6) - 3) is a power of two, so y/quantum is exact and rounds to an integer by the
    2^23 trick (round-to-nearest-even of the fp32 add); every step is exact but that one."""
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    qe = tl.maximum(e, -6) - 3
    t = a * pow2(-qe)
    r = ((t + 8388608.0) - 8388608.0) * pow2(qe)
    r = tl.minimum(r, 448.0)
    return tl.where(y < 0, -r, r)


@triton.jit
def mx8_quant_rows(v, SP: tl.constexpr, BN: tl.constexpr):
    """MXFP8 (E4M3, E8M0 per 32) fake-quant of v [SP, BN]; ref.quant.mx8_fake_quant."""
    return _mx_quant_rows(v, SP, BN, True)


@triton.jit
def perm32(c):
    """Column c -> its place when every 32-block stores its even elements, then its odd ones
    (the layout the nibble-plane MMAs read with contiguous 32-byte loads)."""
    return (c // 32) * 32 + (c % 2) * 16 + (c % 32) // 2


@triton.jit
def gemv(x_ptr, sx, S, w_ptr, sw, n0, N, k_lo, nk, koff, BN: tl.constexpr, BK: tl.constexpr, SP: tl.constexpr,
         XCG: tl.constexpr, SWAP: tl.constexpr = False, XN: tl.constexpr = False, xr=None, inw_ptr=None,
         xout_ptr=None, xst=0):
    """acc[SP, BN] = x[:S, K] @ w[n0:n0+BN, K]^T in fp32 over K = [k_lo, k_lo + nk·BK)
    (rows >= S and >= N read as 0), visiting the BK blocks from block koff on. Each weight
    row streams once in 16-byte vector loads; XCG reads x past L1, for x written by other
    programs of the same launch. SWAP computes w @ x^T ([BN, SP], weights as the MMA's
    M side: with BN >= 64 that is a Hopper warpgroup MMA) and transposes at the end.
    XN: x_ptr is the fp32 mixed row and each block is normalized here, x = bf16(mixed·xr·in_nw)
    as phase C does it (xr [SP]: the rows' rsqrt factors); with xst the block of x is stored to
    xout_ptr too (the x tap)."""
    rs = tl.arange(0, SP)
    rn = n0 + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xm = rs[:, None] < S
    wm = rn[:, None] < N
    if SWAP:
        acct = tl.zeros((BN, SP), dtype=tl.float32)
    else:
        acc = tl.zeros((SP, BN), dtype=tl.float32)
    for it in range(0, nk):
        k0 = k_lo + ((it + koff) % nk) * BK
        if XN:
            m = tl.load(x_ptr + rs[:, None] * sx + (k0 + rk)[None, :], mask=xm, other=0.0, cache_modifier=".cg")
            x = bf16(m * xr[:, None] * tl.load(inw_ptr + k0 + rk).to(tl.float32)[None, :])
            tl.store(xout_ptr + rs[:, None] * sx + (k0 + rk)[None, :], x, mask=rs[:, None] < S * xst)
        elif XCG:
            x = tl.load(x_ptr + rs[:, None] * sx + (k0 + rk)[None, :], mask=xm, other=0.0, cache_modifier=".cg")
        else:
            x = tl.load(x_ptr + rs[:, None] * sx + (k0 + rk)[None, :], mask=xm, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * sw + (k0 + rk)[None, :], mask=wm, other=0.0)
        if SWAP:
            acct = mma(w, tl.trans(x), acct)
        else:
            acc = mma(x, tl.trans(w), acc)
    if SWAP:
        acc = tl.trans(acct)
    return acc


@triton.jit
def ksum(part_ptr, off, mask, plane, SPLIT: tl.constexpr):
    """fp32 sum, in split order from zero, of the SPLIT K-split partials at off of part planes
    `plane` elements apart (written by other programs or an earlier launch: read past L1). One
    order for every reader, so each gets the bits of the others."""
    tot = tl.zeros(off.shape, dtype=tl.float32)
    for k in tl.static_range(SPLIT):
        if mask is None:
            tot += tl.load(part_ptr + k * plane + off, cache_modifier=".cg")
        else:
            tot += tl.load(part_ptr + k * plane + off, mask=mask, other=0.0, cache_modifier=".cg")
    return tot


@triton.jit
def splitk(acc, part_ptr, pitch, ctr_ptr, nb, ks, S, N, n0, BN: tl.constexpr, SP: tl.constexpr,
           SPLIT: tl.constexpr, HAND: tl.constexpr = True):
    """K-split reduction of one output block (columns n0.. of N): (is the caller the block's
    last program, the fp32 sum of all SPLIT partials in split order, ksum).
    part: [SPLIT, SP, pitch] fp32. HAND off: the partials are only stored (a later launch sums
    them with ksum), and no program is the last."""
    if SPLIT == 1:
        return True, acc
    else:
        rs = tl.arange(0, SP)
        rn = n0 + tl.arange(0, BN)
        om = (rs[:, None] < S) & (rn[None, :] < N)
        tl.store(part_ptr + (ks * SP + rs[:, None]) * pitch + rn[None, :], acc, mask=om)
        if HAND:
            tl.debug_barrier()
            last = tl.atomic_add(ctr_ptr + nb, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
            tot = tl.zeros((SP, BN), dtype=tl.float32)
            if last:
                tl.atomic_xchg(ctr_ptr + nb, 0, sem="relaxed", scope="gpu")
                tl.debug_barrier()
                tot = ksum(part_ptr, rs[:, None] * pitch + rn[None, :], om, SP * pitch, SPLIT)
            return last, tot
        else:
            return False, acc


# AttnRes in three ticketed phases over CH column chunks of each token row (chunk c: columns
# [c·HC, (c+1)·HC)). Phase programs of a row meet through counters cnt[t]; every wait is on
# programs with earlier tickets. Scratch: apart [S, CHP, 2·NBP] (per chunk Σ v·c and Σ v² of
# each source), mix [S, H] fp32 (the mixed row, never rounded), msq [S, CHP] (Σ mixed² per chunk).

@triton.jit
def ares_carry(t, c, rh, hm, prefix_ptr, sp, add_ptr, sa, blocks_ptr, sbt, sbb, nw_ptr, qk_ptr, apart_ptr, tapd_ptr, H, CH,
               NB: tl.constexpr, NBP: tl.constexpr, ADD: tl.constexpr,
               WRITE_IDX: tl.constexpr, TAPS: tl.constexpr):
    """Phase A, chunk c of row t: the carry update, then per source the partial Σ v·c and Σ v².

    ADD 0: prefix as is; 1: prefix = bf16(prefix + delta) (K1); 2: prefix = bf16(prefix +
    bf16(d32)) (K2); 3: prefix = bf16(d32) (K2 block-write reset). WRITE_IDX >= 0 copies the
    new prefix into blocks[t, WRITE_IDX] (and that bank row reads as the new prefix).
    The bank rows and weights are loaded first: a load after the prefix stores could not move above
    them and would wait a second DRAM round trip. (The bank rows read never overlap prefix: phase B
    loads them before its wait, too.)"""
    vb = _bank(t, rh, hm, blocks_ptr, sbt, sbb, NBP, NB, WRITE_IDX)
    cw = tl.load(nw_ptr + rh, mask=hm, other=0.0).to(tl.float32) * tl.load(qk_ptr + rh, mask=hm, other=0.0).to(
        tl.float32)
    p = tl.load(prefix_ptr + t * sp + rh, mask=hm, other=0.0)
    if ADD == 1:
        d = tl.load(add_ptr + t * sa + rh, mask=hm, other=0.0)
        pre = bf16(p.to(tl.float32) + d.to(tl.float32))
    elif ADD == 2:
        d = bf16(tl.load(add_ptr + t * sa + rh, mask=hm, other=0.0))
        pre = bf16(p.to(tl.float32) + d.to(tl.float32))
        if TAPS:
            tl.store(tapd_ptr + t * H + rh, d, mask=hm)
    elif ADD == 3:
        pre = bf16(tl.load(add_ptr + t * sa + rh, mask=hm, other=0.0))
        if TAPS:
            tl.store(tapd_ptr + t * H + rh, pre, mask=hm)
    else:
        pre = p
    if ADD != 0:
        tl.store(prefix_ptr + t * sp + rh, pre, mask=hm)
    if WRITE_IDX >= 0:
        tl.store(blocks_ptr + t * sbt + WRITE_IDX * sbb + rh, pre, mask=hm)
    rs = tl.arange(0, NBP)
    v = _sources(vb, rs, pre.to(tl.float32), NB, WRITE_IDX)
    base = apart_ptr + (t * CH + c) * (2 * NBP)
    tl.store(base + rs, tl.sum(v * cw[None, :], axis=1))
    tl.store(base + NBP + rs, tl.sum(v * v, axis=1))


@triton.jit
def ares_mix(t, c, rh, hm, prefix_ptr, sp, bank, apart_ptr, mix_ptr, msq_ptr, H, CH, eps,
             NB: tl.constexpr, NBP: tl.constexpr, CHP: tl.constexpr, WRITE_IDX: tl.constexpr):
    """Phase B, chunk c of row t (after the row's phase A): logits from the chunk partials (summed
    in chunk order), softmax, the mixed chunk Σ p_s·v_s (fp32, stored), its partial Σ mixed².
    bank: the chunk's bank rows (_bank), loaded before the wait (phase A never writes them)."""
    rs = tl.arange(0, NBP)
    rc = tl.arange(0, CHP)
    pm = (rc < CH)[:, None]
    pb = apart_ptr + t * CH * (2 * NBP) + rc[:, None] * (2 * NBP) + rs[None, :]
    dot = tl.sum(tl.load(pb, mask=pm, other=0.0, cache_modifier=".cg"), axis=0)
    sq = tl.sum(tl.load(pb + NBP, mask=pm, other=0.0, cache_modifier=".cg"), axis=0)
    logit = dot * rsqrt(sq / H + eps)
    logit = tl.where(rs <= NB, logit, float("-inf"))
    ex = tl.exp(logit - tl.max(logit, axis=0))
    p = ex / tl.sum(ex, axis=0)
    pre = tl.load(prefix_ptr + t * sp + rh, mask=hm, other=0.0, cache_modifier=".cg").to(tl.float32)
    v = _sources(bank, rs, pre, NB, WRITE_IDX)
    mixed = tl.sum(p[:, None] * v, axis=0)
    tl.store(mix_ptr + t * H + rh, mixed, mask=hm)
    tl.store(msq_ptr + t * CHP + c, tl.sum(mixed * mixed, axis=0))


@triton.jit
def ares_norm(t, c, rh, hm, mix_ptr, msq_ptr, w, x_ptr, sx, H, CH, out_eps, CHP: tl.constexpr):
    """Phase C, chunk c of row t (after the row's phase B): x = bf16(mixed·rsqrt(mean(mixed²) +
    out_eps)·in_nw), the one rounding of the input norm. w: the chunk's in_nw (fp32), loaded
    before the wait."""
    r = rsqrt(msq_row(msq_ptr, t, t >= 0, CH, CHP) / H + out_eps)
    mixed = tl.load(mix_ptr + t * H + rh, mask=hm, other=0.0, cache_modifier=".cg")
    tl.store(x_ptr + t * sx + rh, bf16(mixed * r * w), mask=hm)


@triton.jit
def msq_row(msq_ptr, t, tm, CH, CHP: tl.constexpr):
    """Σ mixed² of row(s) t (a scalar or a vector; rows outside the mask tm read 0): the row's chunk
    partials added one by one in chunk order, so phase C and the in_proj items of k1_xc (each
    normalizing x itself) get the same fp32 bits."""
    ms = tl.load(msq_ptr + t * CHP, mask=tm, other=0.0, cache_modifier=".cg")
    for c in tl.static_range(1, CHP):
        ms += tl.load(msq_ptr + t * CHP + c, mask=tm & (t * 0 + c < CH), other=0.0, cache_modifier=".cg")
    return ms


@triton.jit
def ares_phases(ticket, ctr_ptr, S, spin, prefix_ptr, sp, add_ptr, sa, blocks_ptr, sbt, sbb, nw_ptr, qk_ptr,
                inw_ptr, x_ptr, tapd_ptr, apart_ptr, mix_ptr, msq_ptr, H, HC, CH, eps, out_eps,
                NB: tl.constexpr, NBP: tl.constexpr, CHP: tl.constexpr, BHC: tl.constexpr, ADD: tl.constexpr,
                WRITE_IDX: tl.constexpr, TAPS: tl.constexpr, XC: tl.constexpr = False, LD: tl.constexpr = False,
                NAP: tl.constexpr = 0):
    """The AttnRes role of tickets [0, 3·S·CH): A, B, C phases (see above) of (row, chunk)
    ticket % (S·CH). ctr: [.., 1 x chunks ready, .., 3 spin overflow, .., 8+t phase A of row t,
    8+S+t phase B of row t]. Phase C publishes its x chunk into ctr[1] (release). XC: no phase C
    (tickets [0, 2·S·CH)); phase B publishes its mixed chunk into ctr[1], the consumers normalize."""
    NA = S * CH
    ph = ticket // NA
    j = ticket % NA
    t = j // CH
    c = j % CH
    rh = c * HC + tl.arange(0, BHC)  # the chunk's columns
    hm = (tl.arange(0, BHC) < HC) & (rh < H)
    if ph == 0:
        ares_carry(t, c, rh, hm, prefix_ptr, sp, add_ptr, sa, blocks_ptr, sbt, sbb, nw_ptr, qk_ptr, apart_ptr, tapd_ptr,
                   H, CH, NB, NBP, ADD, WRITE_IDX, TAPS)
        tl.debug_barrier()
        tl.atomic_add(ctr_ptr + 8 + t, 1, sem="release", scope="gpu")
    elif ph == 1:
        bank = _bank(t, rh, hm, blocks_ptr, sbt, sbb, NBP, NB, WRITE_IDX)
        wait_ge(ctr_ptr + 8 + t, CH, spin, ctr_ptr + 3, LD, NAP)
        ares_mix(t, c, rh, hm, prefix_ptr, sp, bank, apart_ptr, mix_ptr, msq_ptr, H, CH, eps,
                 NB, NBP, CHP, WRITE_IDX)
        tl.debug_barrier()
        tl.atomic_add(ctr_ptr + (1 if XC else 8 + S + t), 1, sem="release", scope="gpu")
    else:
        w = tl.load(inw_ptr + rh, mask=hm, other=0.0).to(tl.float32)
        wait_ge(ctr_ptr + 8 + S + t, CH, spin, ctr_ptr + 3, LD, NAP)
        ares_norm(t, c, rh, hm, mix_ptr, msq_ptr, w, x_ptr, H, H, CH, out_eps, CHP)
        tl.debug_barrier()
        tl.atomic_add(ctr_ptr + 1, 1, sem="release", scope="gpu")


@triton.jit
def ticket_reset(ctr_ptr, S, TP: tl.constexpr):
    """A ticketed launch's counters back to 0 for the next launch (ticket, x chunks ready, router
    blocks, the per-row phase counts; then done): by its last program, or by a launch that
    runs after it has completed."""
    tl.atomic_xchg(ctr_ptr, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctr_ptr + 1, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(ctr_ptr + 4, 0, sem="relaxed", scope="gpu")
    rt = tl.arange(0, 2 * TP)
    tl.store(ctr_ptr + 8 + rt, tl.zeros((2 * TP,), dtype=tl.int32), mask=rt < 2 * S)
    tl.debug_barrier()
    tl.atomic_xchg(ctr_ptr + 2, 0, sem="relaxed", scope="gpu")


@triton.jit
def ticket_done(ctr_ptr, total, S, TP: tl.constexpr):
    """Count this program done; the last of `total` resets the launch's counters (ticket_reset)."""
    tl.debug_barrier()
    if tl.atomic_add(ctr_ptr + 2, 1, sem="acq_rel", scope="gpu") == total - 1:
        ticket_reset(ctr_ptr, S, TP)


@triton.jit
def _bank(t, rh, hm, blocks_ptr, sbt, sbb, NBP: tl.constexpr, NB: tl.constexpr, WRITE_IDX: tl.constexpr):
    """[NBP, BHC] fp32: bank rows 0..NB-1 of row t at columns rh, except row WRITE_IDX (the
    one row AttnRes writes), zeros there and below."""
    rs = tl.arange(0, NBP)
    isb = (rs < NB) & (rs != WRITE_IDX)
    return tl.load(blocks_ptr + t * sbt + rs[:, None] * sbb + rh[None, :],
                   mask=isb[:, None] & hm[None, :], other=0.0).to(tl.float32)


@triton.jit
def _sources(vb, rs, pre, NB: tl.constexpr, WRITE_IDX: tl.constexpr):
    """[NBP, BHC] fp32: the bank rows vb (_bank) with row WRITE_IDX read as the new prefix, the
    prefix `pre` (fp32 values) as row NB, zeros below."""
    isb = (rs < NB) & (rs != WRITE_IDX)
    isp = (rs == NB) | ((rs == WRITE_IDX) & (rs < NB))
    return tl.where(isb[:, None], vb, tl.where(isp[:, None], pre[None, :], 0.0))
