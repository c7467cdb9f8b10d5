"""FlyDSL kernels of K1 and K2, one factory per kernel kind.

A factory takes a frozen *spec* (scalars only: dims, epsilons, flags) and returns a
`@flyc.jit` launcher. Every spec field is a trace-time constant, and the kernel's
symbol name carries a digest of the whole spec, so every field reaches FlyDSL's
compile cache key (which hashes the IR text and the target arch). Factories are
memoized on the spec. Algorithms, work splits and rounding points: docs/flydsl.md.
"""

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr

from . import layouts as LY
from .device import (BF16, F32, I32, NEG_INF, U8, U32, WAVE, bf16, block_sums, copy_atom, e2m1_value,
                     e8m0_value, f32, load_chunk, mx8_fake_quant32, mx_fake_quant32, rbf, row_chunks, rsqrt,
                     sigmoid, silu, situ, wave_sum)

VEC = 8  # bf16 elements per 128-bit load
QB = 32  # quant block (k values per 16 packed bytes)
E2M1_WEIGHTS = ("mxfp4", "a8w4")  # expert formats with MXFP4 weights (E2M1 codes, E8M0 scales)
ACT_QUANT = {"mxfp4": mx_fake_quant32, "a8w4": mx8_fake_quant32}  # activations quantized per 32
EW_QUANT = {"mxq": mx_fake_quant32, "mx8q": mx8_fake_quant32}


def kernel_name(kind: str, spec) -> str:
    digest = hashlib.sha256(repr(spec).encode()).hexdigest()[:12]
    return f"k3_{kind}_{digest}"


def _min_waves(launch, waves: int):
    """Ask LLVM for at least `waves` waves per SIMD (amdgpu-waves-per-eu): it then keeps
    the kernel within 512/waves VGPRs, spilling to scratch rather than exceed them (the
    compile tier fails on any scratch)."""
    launch.compile_hints = {**launch.compile_hints, "waves_per_eu": waves}
    return launch


def _pow2_at_least(n: int, cap: int = WAVE) -> int:
    p = 1
    while p < n and p < cap:
        p *= 2
    return p


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ====================================================================== AttnRes

def _bank(blk, t, s, c, pre_i, wrow: int, ok):
    """Bank row s at column c as fp32: the prefix from registers when s is the row this
    launch wrote (wrow), 0 where `ok` is False (ragged columns)."""
    v = f32(blk[t, s, c])
    if wrow >= 0:
        v = (s == wrow).select(pre_i, v)
    if ok is not None:
        v = ok.select(v, 0.0)
    return v


def _dot_sq(v: list, cw: list):
    """(Σ_i v_i·cw_i, Σ_i v_i²) over a thread's columns, in column order."""
    dot = F32(0.0)
    sq = F32(0.0)
    for vi, ci in zip(v, cw):
        dot = dot + vi * ci
        sq = sq + vi * vi
    return dot, sq


def attnres_threads(H: int) -> int:
    """Threads of an AttnRes block: about 8 columns per thread, 64..1024."""
    return min(1024, max(WAVE, _pow2_at_least(_cdiv(H, 8), 1024)))


@dataclass(frozen=True)
class AttnResSpec:
    """K1 steps 1-3 (mode k1) or K2 steps 1(rounding)-3 (mode k2) for one token row per block."""

    mode: str  # "k1" | "k2"
    S: int
    H: int
    NB: int  # sources from the bank (nblocks); the prefix is source NB
    delta: bool  # k1: a pending delta is added
    write_idx: int  # k1: bank row written with the prefix (-1: none)
    reset: bool  # k2: prefix = delta (block-write layer)
    eps: float
    out_eps: float
    threads: int = 256


@functools.lru_cache(maxsize=None)
def attnres(spec: AttnResSpec):
    """launch(prefix, dsrc, blocks, ares_nw, ares_qk, in_nw, x_out, delta_out, stream)

    k1: dsrc = delta [S, H] bf16 (ignored unless spec.delta); k2: dsrc = the o_proj
    all-reduce [S, H] fp32, delta_out receives bf16(dsrc). One block per token row;
    thread t owns columns t, t+T, t+2T, ...
    """
    S, H, NB, T = spec.S, spec.H, spec.NB, spec.threads
    CPT = _cdiv(H, T)
    NWAVES = T // WAVE
    K1, K2 = spec.mode == "k1", spec.mode == "k2"
    ragged = H % T != 0
    NSRC = NB + 1
    name = kernel_name("attnres", spec)

    wrow = spec.write_idx if K1 else -1  # the bank row this launch writes (read back from registers)

    @fx.struct
    class Smem:
        red: fx.Array[F32, NWAVES * 2, 16]
        lgt: fx.Array[F32, NSRC, 16]

    @flyc.kernel(name=name)
    def kern(PRE: fx.Tensor, DSRC: fx.Tensor, BLK: fx.Tensor, NW: fx.Tensor, QK: fx.Tensor, INW: fx.Tensor,
             XO: fx.Tensor, DO: fx.Tensor):
        t = gpu.block_idx.x
        tid = gpu.thread_idx.x
        wave = tid // WAVE
        lds = fx.SharedAllocator().allocate(Smem).peek()
        red = lds.red.view(fx.make_layout(NWAVES * 2, 1))
        lgt = lds.lgt.view(fx.make_layout(NSRC, 1))
        cols = [tid + T * i for i in range_constexpr(CPT)]
        ok = [cols[i] < H for i in range_constexpr(CPT)]
        cc = [ok[i].select(cols[i], 0) if const_expr(ragged) else cols[i] for i in range_constexpr(CPT)]

        # 1. the prefix this layer sees (bf16 values)
        pre = []
        for i in range_constexpr(CPT):
            p = PRE[t, cc[i]]
            if const_expr(K1 and spec.delta):
                p = bf16(f32(p) + f32(DSRC[t, cc[i]]))  # pending delta: one bf16 add
            if const_expr(K2):
                d = bf16(DSRC[t, cc[i]])  # the all-reduced o_proj, rounded once
                if ok[i]:
                    DO[t, cols[i]] = d
                if const_expr(not spec.reset):
                    p = bf16(f32(p) + f32(d))
                else:
                    p = d
            if const_expr((K1 and spec.delta) or K2):
                if ok[i]:
                    PRE[t, cols[i]] = p
            if const_expr(K1 and spec.write_idx >= 0):
                if ok[i]:
                    BLK[t, spec.write_idx, cols[i]] = p
            pre.append(f32(p))

        # 2. AttnRes logits: per source Σ v·c and Σ v² (c = res_norm.w ⊙ res_proj.w in fp32);
        # bank rows in a device loop (one row's values live at a time), the prefix last
        cw = [f32(NW[cc[i]]) * f32(QK[cc[i]]) for i in range_constexpr(CPT)]
        if const_expr(ragged):
            cw = [ok[i].select(cw[i], 0.0) for i in range_constexpr(CPT)]
        if const_expr(NB > 0):
            for s in range(NB, unroll=1):
                v = [_bank(BLK, t, s, cc[i], pre[i], wrow, ok[i] if const_expr(ragged) else None)
                     for i in range_constexpr(CPT)]
                tot = block_sums(list(_dot_sq(v, cw)), red, wave, NWAVES)
                if tid == 0:
                    lgt[s] = tot[0] * rsqrt(tot[1] / float(H) + spec.eps)
        vpre = [ok[i].select(pre[i], 0.0) if const_expr(ragged) else pre[i] for i in range_constexpr(CPT)]
        tot = block_sums(list(_dot_sq(vpre, cw)), red, wave, NWAVES)  # its barriers publish lgt
        logit = [lgt[s] for s in range_constexpr(NB)] + [tot[0] * rsqrt(tot[1] / float(H) + spec.eps)]
        m = logit[0]
        for s in range_constexpr(1, NSRC):
            m = fx.max(m, logit[s])
        ex = [fx.math.exp(logit[s] - m) for s in range_constexpr(NSRC)]
        z = ex[0]
        for s in range_constexpr(1, NSRC):
            z = z + ex[s]

        # mixed = Σ_s p_s·v_s over raw v (fp32, not rounded; sources in order, bank rows
        # re-read), then the input RMSNorm
        mixed = [F32(0.0) for _ in range_constexpr(CPT)]
        if const_expr(NB > 0):
            for s in range(NB, unroll=1):
                pw = fx.math.exp(lgt[s] - m) / z  # the same ops as ex[s] / z
                mixed = [mixed[i] + pw * _bank(BLK, t, s, cc[i], pre[i], wrow, None) for i in range_constexpr(CPT)]
        ppre = ex[NB] / z
        mixed = [mixed[i] + ppre * pre[i] for i in range_constexpr(CPT)]
        if const_expr(ragged):
            mixed = [ok[i].select(mixed[i], 0.0) for i in range_constexpr(CPT)]
        sq = F32(0.0)
        for i in range_constexpr(CPT):
            sq = sq + mixed[i] * mixed[i]
        ms = block_sums([sq], red, wave, NWAVES)[0]
        r = rsqrt(ms / float(H) + spec.out_eps)
        for i in range_constexpr(CPT):
            xv = bf16(mixed[i] * r * f32(INW[cc[i]]))  # the norm's one rounding
            if ok[i]:
                XO[t, cols[i]] = xv

    @flyc.jit
    def launch(PRE: fx.Tensor, DSRC: fx.Tensor, BLK: fx.Tensor, NW: fx.Tensor, QK: fx.Tensor, INW: fx.Tensor,
               XO: fx.Tensor, DO: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        kern(PRE, DSRC, BLK, NW, QK, INW, XO, DO).launch(grid=(S, 1, 1), block=(T, 1, 1), stream=stream)

    return _min_waves(launch, 4)


# ====================================================================== dense GEMV

GEMV_WAVES = 4096  # planning target of a GEMV grid: 4 waves on each of the 1024 SIMDs of a 256-CU MI355X


@dataclass(frozen=True)
class GemvSpec:
    """y[s, n] = Σ_k x[s, k]·w[n, k] for S ≤ 16 token rows (bf16 x, bf16 w, fp32 sums).

    A block of `waves` waves: `ksplit` adjacent waves share a row group and split K into
    contiguous ranges; a wave holds WAVE/lpr lane groups of `rpg` rows each."""

    tag: str  # which projection (names the kernel)
    S: int
    N: int
    K: int
    out: str  # "bf16": bf16(acc) | "f32": acc | "add_bf16": bf16(acc + res)
    rpg: int = 2  # output rows per lane group
    waves: int = 4
    ksplit: int = 1  # waves of a block splitting K (1, 2, 4)
    min_waves: int = 4  # occupancy floor asked of LLVM (waves per SIMD)

    @property
    def lpr(self) -> int:
        return _pow2_at_least(self.K // VEC)

    @property
    def chunks_per_split(self) -> int:
        return self.K // VEC // self.ksplit

    @property
    def rows_per_block(self) -> int:
        return self.waves // self.ksplit * (WAVE // self.lpr) * self.rpg

    @property
    def grid(self) -> int:
        return _cdiv(self.N, self.rows_per_block)


def plan_gemv(tag: str, S: int, N: int, K: int, out: str) -> GemvSpec:
    """The GEMV launch of one projection: K split over 1, 2 or 4 waves, the smallest split
    whose grid reaches GEMV_WAVES waves, as long as every split keeps a full lane step."""
    sp = GemvSpec(tag, S, N, K, out)
    for ks in (2, 4):
        if sp.grid * sp.waves >= GEMV_WAVES:
            break
        cand = dataclasses.replace(sp, ksplit=ks)
        if (K // VEC) % ks or cand.chunks_per_split < cand.lpr:
            break
        sp = cand
    return sp


def _gemv_step(acc: list, x_chunks, w_chunks, c, valid, atom) -> list:
    """acc[s·R + r] += Σ_e x[s, 8c+e]·w[r, 8c+e] (an 8-product sum, then one add); every
    load of the step is issued before the first product. valid=False adds 0."""
    R = len(w_chunks)
    wr = [load_chunk(w, c, VEC, BF16, atom) for w in w_chunks]
    xr = [load_chunk(x, c, VEC, BF16, atom) for x in x_chunks]
    ws = [f32(w) for w in wr]
    out = list(acc)
    for s, xv in enumerate(xr):
        xs = f32(xv)
        for r in range(R):
            d = (xs * ws[r]).reduce(fx.ReductionOp.ADD)
            if valid is not None:
                d = valid.select(d, 0.0)
            out[s * R + r] = acc[s * R + r] + d
    return out


@functools.lru_cache(maxsize=None)
def gemv(spec: GemvSpec):
    """launch(X [S, K] bf16, W [N, K] bf16, Y [S, N], RES [S, N] bf16 (add_bf16 only), stream)

    Lane klane of split ks adds chunks ks·CPS + klane + lpr·it (it ascending; CPS chunks of
    8 per split) into its fp32 partials; an xor butterfly over the lpr lanes; then the
    ksplit partials are added in split order (LDS) by the wave of split 0."""
    S, N, K, RPG, LPR, KS = spec.S, spec.N, spec.K, spec.rpg, spec.lpr, spec.ksplit
    if K % VEC:
        raise ValueError(f"gemv {spec.tag}: K={K} is not a multiple of {VEC}")
    if spec.waves % KS or (K // VEC) % KS:
        raise ValueError(f"gemv {spec.tag}: ksplit={KS} does not divide {spec.waves} waves and {K // VEC} chunks")
    G = WAVE // LPR
    RGB = spec.waves // KS  # row groups per block
    CPS = spec.chunks_per_split
    FULL, TAIL = CPS // LPR, CPS % LPR  # full lane steps; lanes of the last, partial step
    NACC = S * RPG
    name = kernel_name(f"gemv_{spec.tag}", spec)
    lanes = LY.lane_split(LPR)
    wsplit = LY.gemv_waves(KS, RGB)
    chunks = LY.gemv_chunks(LPR, FULL + (1 if TAIL else 0), KS, CPS)

    @fx.struct
    class Smem:
        part: fx.Array[F32, spec.waves * G * NACC, 16]

    @flyc.kernel(name=name)
    def kern(X: fx.Tensor, W: fx.Tensor, Y: fx.Tensor, RES: fx.Tensor):
        tid = gpu.thread_idx.x
        lane = tid % WAVE
        wave = tid // WAVE
        klane, grp = LY.coord_of(lanes, lane)
        ks, rg = LY.coord_of(wsplit, wave)
        row0 = ((gpu.block_idx.x * RGB + rg) * G + grp) * RPG
        rows = [row0 + j for j in range_constexpr(RPG)]
        rowc = [(rows[j] < N).select(rows[j], N - 1) for j in range_constexpr(RPG)]
        atom = copy_atom(BF16)
        xch = [row_chunks(X, (s, None), VEC) for s in range_constexpr(S)]
        wch = [row_chunks(W, (rowc[j], None), VEC) for j in range_constexpr(RPG)]
        acc = [F32(0.0) for _ in range_constexpr(NACC)]  # acc[s·RPG + j]
        for it in range(FULL):  # a device loop: one step's loads live at a time
            acc = _gemv_step(acc, xch, wch, LY.at(chunks, (klane, it, ks)), None, atom)
        if const_expr(TAIL):
            ok = klane < TAIL
            c = LY.at(chunks, (klane, FULL, ks))
            acc = _gemv_step(acc, xch, wch, ok.select(c, 0), ok, atom)
        acc = [wave_sum(acc[i], LPR) for i in range_constexpr(NACC)]
        if const_expr(KS > 1):
            lds = fx.SharedAllocator().allocate(Smem).peek()
            part = lds.part.view(fx.make_layout(spec.waves * G * NACC, 1))
            base = (wave * G + grp) * NACC
            if klane == 0:
                for i in range_constexpr(NACC):
                    part[base + i] = acc[i]
            gpu.barrier()
            # the partials of the K splits, added in split order
            for i in range_constexpr(NACC):
                tot = part[(rg * KS * G + grp) * NACC + i]
                for k in range_constexpr(1, KS):
                    tot = tot + part[((rg * KS + k) * G + grp) * NACC + i]
                acc[i] = tot
        if (klane == 0) & (ks == 0):
            for j in range_constexpr(RPG):
                if rows[j] < N:
                    for s in range_constexpr(S):
                        if const_expr(spec.out == "bf16"):
                            Y[s, rows[j]] = bf16(acc[s * RPG + j])
                        if const_expr(spec.out == "f32"):
                            Y[s, rows[j]] = acc[s * RPG + j]
                        if const_expr(spec.out == "add_bf16"):
                            Y[s, rows[j]] = bf16(acc[s * RPG + j] + f32(RES[s, rows[j]]))  # one rounding

    @flyc.jit
    def launch(X: fx.Tensor, W: fx.Tensor, Y: fx.Tensor, RES: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        kern(X, W, Y, RES).launch(grid=(spec.grid, 1, 1), block=(spec.waves * WAVE, 1, 1), stream=stream)

    return _min_waves(launch, spec.min_waves)


# ====================================================================== K1: conv, gates, KDA

@dataclass(frozen=True)
class ConvSpec:
    R: int
    L: int
    C: int  # 3P channels (q|k|v)
    W: int  # conv width
    SL: int  # state_len
    w_dtype: str  # conv_w: "f32" (vLLM's conv1d.weight) | "bf16"
    threads: int = 256


@functools.lru_cache(maxsize=None)
def conv(spec: ConvSpec):
    """launch(PROJ [S, NP] bf16, CW [C, W] f32|bf16, CS [slots, C, SL] bf16, ST [R, ≥L] i32,
    NA [R] i32, OUT [S, C] bf16, stream). Thread = (request, channel)."""
    R, L, C, W, T = spec.R, spec.L, spec.C, spec.W, spec.threads
    KEEP = W - 2 + L
    name = kernel_name("conv", spec)

    @flyc.kernel(name=name)
    def kern(PROJ: fx.Tensor, CW: fx.Tensor, CS: fx.Tensor, ST: fx.Tensor, NA: fx.Tensor, OUT: fx.Tensor):
        r = gpu.block_idx.y
        c = gpu.block_idx.x * T + gpu.thread_idx.x
        ok = c < C
        cc = ok.select(c, 0)
        sc = ST[r, 0]
        a = NA[r]
        rd = (sc > 0).select(sc, 0)  # a null slot reads slot 0
        seq = [CS[rd, cc, a - 1 + q] for q in range_constexpr(W - 1)]
        seq += [PROJ[r * L + j, cc] for j in range_constexpr(L)]
        wq = [f32(CW[cc, q]) for q in range_constexpr(W)]  # fp32 or bf16 weights, read exactly
        outs = []
        for j in range_constexpr(L):
            # fp32 products and sum (an fp32 weight rounds each product to fp32, a bf16 one
            # makes it exact), then silu; bf16 only at the output
            y = wq[0] * f32(seq[j])
            for q in range_constexpr(1, W):
                y = y + wq[q] * f32(seq[j + q])
            outs.append(bf16(silu(y)))  # the conv's one rounding
        if ok:
            for j in range_constexpr(L):
                OUT[r * L + j, c] = outs[j]
        # window for the next step: the last W-2 window entries, then the L new in_proj values
        if ok & (sc > 0):
            for p in range_constexpr(KEEP):
                CS[sc, c, p] = seq[p + 1]

    @flyc.jit
    def launch(PROJ: fx.Tensor, CW: fx.Tensor, CS: fx.Tensor, ST: fx.Tensor, NA: fx.Tensor, OUT: fx.Tensor,
               stream: fx.Stream = fx.Stream(None)):
        kern(PROJ, CW, CS, ST, NA, OUT).launch(grid=(_cdiv(C, T), R, 1), block=(T, 1, 1), stream=stream)

    return launch


@dataclass(frozen=True)
class GateSpec:
    S: int
    NH: int
    HD: int
    RANK: int
    fa_col: int  # first f_a column of proj (4P)
    b_col: int  # first b column of proj (4P + RANK)
    lower_bound: float
    threads: int = 256


@functools.lru_cache(maxsize=None)
def gate(spec: GateSpec):
    """launch(PROJ [S, NP] bf16, WFB [P, RANK] bf16, ALOG [NH] f32, DTB [P] f32,
    GATE [S, NH, HD] f32, BETA [S, NH] f32, stream). Thread = (token, channel p)."""
    S, NH, HD, RK, T = spec.S, spec.NH, spec.HD, spec.RANK, spec.threads
    P = NH * HD
    if RK % VEC or spec.fa_col % VEC:
        raise ValueError(f"gate: RANK={RK} and f_a column {spec.fa_col} must be multiples of {VEC}")
    heads = LY.head_channel(NH, HD)  # p -> (i, h)
    name = kernel_name("gate", spec)

    @flyc.kernel(name=name)
    def kern(PROJ: fx.Tensor, WFB: fx.Tensor, ALOG: fx.Tensor, DTB: fx.Tensor, GATE: fx.Tensor, BETA: fx.Tensor):
        t = gpu.block_idx.y
        tid = gpu.thread_idx.x
        p = gpu.block_idx.x * T + tid
        ok = p < P
        pc = ok.select(p, 0)
        i, h = LY.coord_of(heads, pc)
        atom = copy_atom(BF16)
        fa = row_chunks(PROJ, (t, None), VEC)
        wr = row_chunks(WFB, (pc, None), VEC)
        acc = F32(0.0)
        for c in range_constexpr(RK // VEC):
            xs = f32(load_chunk(fa, spec.fa_col // VEC + c, VEC, BF16, atom))
            ws = f32(load_chunk(wr, c, VEC, BF16, atom))
            acc = acc + (xs * ws).reduce(fx.ReductionOp.ADD)
        g1 = rbf(acc)  # g1 = bf16(f_a @ w_fb^T): the gate's one rounding
        arg = fx.math.exp(ALOG[h]) * (g1 + DTB[pc])
        g = sigmoid(arg) * spec.lower_bound
        if ok:
            GATE[t, h, i] = g
        if (gpu.block_idx.x == 0) & (tid < NH):
            BETA[t, tid] = sigmoid(f32(PROJ[t, spec.b_col + tid]))

    @flyc.jit
    def launch(PROJ: fx.Tensor, WFB: fx.Tensor, ALOG: fx.Tensor, DTB: fx.Tensor, GATE: fx.Tensor, BETA: fx.Tensor,
               stream: fx.Stream = fx.Stream(None)):
        kern(PROJ, WFB, ALOG, DTB, GATE, BETA).launch(grid=(_cdiv(P, T), S, 1), block=(T, 1, 1), stream=stream)

    return launch


def kda_ksplit(hd: int) -> int:
    """Lanes per state row of the KDA kernel: 8 (HD/8 columns each, HD·8 threads) while
    that fits a block of 1024 threads, else 4."""
    return 8 if hd * 8 <= 1024 else 4


@dataclass(frozen=True)
class KdaSpec:
    R: int
    L: int
    NH: int
    HD: int
    onorm_eps: float
    debug: bool  # also write the `o` tap
    ksplit: int = 4
    l2_eps: float = 1e-6


@functools.lru_cache(maxsize=None)
def kda(spec: KdaSpec):
    """launch(CONV [S, 3P] bf16, PROJ [S, NP] bf16, GATE [S, NH, HD] f32, BETA [S, NH] f32,
    RSTATE [slots, NH, HD, HD] f32, ST [R, ≥L] i32, NA [R] i32, ONW [HD] bf16,
    CORE [S, P] bf16, OTAP [S, NH, HD] bf16, stream). Block = (head, request)."""
    R, L, NH, HD, KS = spec.R, spec.L, spec.NH, spec.HD, spec.ksplit
    P = NH * HD
    KC = HD // KS
    T = HD * KS
    NWAVES = _cdiv(T, WAVE)
    if HD % KS or T > 1024 or KS > WAVE or T % WAVE:
        raise ValueError(f"kda: HD={HD} with ksplit={KS} gives {T} threads (need a multiple of 64, ≤ 1024)")
    split, kcol = LY.kda_split(HD, KS), LY.kda_kcol(HD, KS)
    cols = LY.proj_heads(NH, HD)
    name = kernel_name("kda", spec)

    @fx.struct
    class Smem:
        red: fx.Array[F32, NWAVES, 16]

    @flyc.kernel(name=name)
    def kern(CONV: fx.Tensor, PROJ: fx.Tensor, GATE: fx.Tensor, BETA: fx.Tensor, RS: fx.Tensor, ST: fx.Tensor,
             NA: fx.Tensor, ONW: fx.Tensor, CORE: fx.Tensor, OTAP: fx.Tensor):
        h = gpu.block_idx.x
        r = gpu.block_idx.y
        tid = gpu.thread_idx.x
        wave = tid // WAVE
        lds = fx.SharedAllocator().allocate(Smem).peek()
        red = lds.red.view(fx.make_layout(NWAVES, 1))
        kq, v = LY.coord_of(split, tid)
        ks = [LY.at(kcol, (i, kq)) for i in range_constexpr(KC)]
        a = NA[r]
        s0 = ST[r, a - 1]
        live = s0 > 0  # a null start slot marks a padding request
        rd = live.select(s0, 0)
        st = [RS[rd, h, v, ks[i]] for i in range_constexpr(KC)]  # state row v, this lane's columns
        onw = f32(ONW[v])
        qc = [LY.at(cols, (ks[i], h, 0)) for i in range_constexpr(KC)]
        kc = [LY.at(cols, (ks[i], h, 1)) for i in range_constexpr(KC)]
        vcol = LY.at(cols, (v, h, 2))
        gcol = LY.at(cols, (v, h, 3))
        for j in range_constexpr(L):
            tok = r * L + j
            q = [f32(CONV[tok, qc[i]]) for i in range_constexpr(KC)]
            k = [f32(CONV[tok, kc[i]]) for i in range_constexpr(KC)]
            qq = F32(0.0)
            kk = F32(0.0)
            for i in range_constexpr(KC):
                qq = qq + q[i] * q[i]
                kk = kk + k[i] * k[i]
            qq = wave_sum(qq, KS)
            kk = wave_sum(kk, KS)
            rq = rsqrt(qq + spec.l2_eps)
            rk = rsqrt(kk + spec.l2_eps)
            qn = [q[i] * rq * (HD ** -0.5) for i in range_constexpr(KC)]  # L2-normed, never rounded
            kn = [k[i] * rk for i in range_constexpr(KC)]
            beta = BETA[tok, h]
            st = [st[i] * fx.math.exp(GATE[tok, h, ks[i]]) for i in range_constexpr(KC)]
            pred = F32(0.0)
            for i in range_constexpr(KC):
                pred = pred + st[i] * kn[i]
            pred = wave_sum(pred, KS)
            u = (f32(CONV[tok, vcol]) - pred) * beta
            st = [st[i] + u * kn[i] for i in range_constexpr(KC)]
            o = F32(0.0)
            for i in range_constexpr(KC):
                o = o + st[i] * qn[i]
            o = wave_sum(o, KS)
            ob = live.select(rbf(o), 0.0)  # o = bf16(S·q); padding requests output 0
            slot = ST[r, j]
            if live & (slot > 0):
                for i in range_constexpr(KC):
                    RS[slot, h, v, ks[i]] = st[i]
            if const_expr(spec.debug):
                if kq == 0:
                    OTAP[tok, h, v] = bf16(ob)
            # gated RMSNorm over the head's HD outputs (each v counted once: lanes kq == 0)
            ss = block_sums([(kq == 0).select(ob * ob, 0.0)], red, wave, NWAVES)[0]
            rn = rsqrt(ss / float(HD) + spec.onorm_eps)
            core = bf16(ob * rn * onw * sigmoid(f32(PROJ[tok, gcol])))  # the norm's one rounding
            if kq == 0:
                CORE[tok, LY.at(cols, (v, h, 0))] = core

    @flyc.jit
    def launch(CONV: fx.Tensor, PROJ: fx.Tensor, GATE: fx.Tensor, BETA: fx.Tensor, RS: fx.Tensor, ST: fx.Tensor,
               NA: fx.Tensor, ONW: fx.Tensor, CORE: fx.Tensor, OTAP: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        kern(CONV, PROJ, GATE, BETA, RS, ST, NA, ONW, CORE, OTAP).launch(grid=(NH, R, 1), block=(T, 1, 1),
                                                                         stream=stream)

    return launch


# ====================================================================== K2: router, experts, tail

@dataclass(frozen=True)
class TopkSpec:
    S: int
    E: int
    K: int
    bias: str  # router bias dtype: "f32" | "bf16" (read exactly)
    threads: int = 256


@functools.lru_cache(maxsize=None)
def topk(spec: TopkSpec):
    """launch(LOGITS [S, E] f32, BIAS [E] f32|bf16, IDS [S, K] i32, TW [S, K] f32, stream).

    One block per token. K rounds of a block-wide argmax of key = σ + bias under the
    total order (key descending, id ascending), NaN keys ranked as -inf; the winner
    leaves the candidate set. Weights: σ (NaN -> 0) over their sum in pick order.
    """
    S, E, K, T = spec.S, spec.E, spec.K, spec.threads
    EPT = _cdiv(E, T)
    NWAVES = T // WAVE
    own = LY.experts_of_thread(T, EPT)
    name = kernel_name("topk", spec)

    @fx.struct
    class Smem:
        key: fx.Array[F32, NWAVES, 16]
        sig: fx.Array[F32, NWAVES, 16]
        idx: fx.Array[I32, NWAVES, 16]

    def better(ka, ia, kb, ib):
        return (ka > kb) | ((ka == kb) & (ia < ib))

    @flyc.kernel(name=name)
    def kern(LG: fx.Tensor, BIAS: fx.Tensor, IDS: fx.Tensor, TW: fx.Tensor):
        t = gpu.block_idx.x
        tid = gpu.thread_idx.x
        wave = tid // WAVE
        lds = fx.SharedAllocator().allocate(Smem).peek()
        lkey = lds.key.view(fx.make_layout(NWAVES, 1))
        lsig = lds.sig.view(fx.make_layout(NWAVES, 1))
        lidx = lds.idx.view(fx.make_layout(NWAVES, 1))
        eid = [LY.at(own, (tid, i)) for i in range_constexpr(EPT)]
        valid = [eid[i] < E for i in range_constexpr(EPT)]
        ec = [valid[i].select(eid[i], 0) for i in range_constexpr(EPT)]
        sig = [sigmoid(LG[t, ec[i]]) for i in range_constexpr(EPT)]
        key = [sig[i] + f32(BIAS[ec[i]]) for i in range_constexpr(EPT)]  # a bf16 bias widens exactly
        key = [fx.math.isnan(key[i]).select(NEG_INF, key[i]) for i in range_constexpr(EPT)]  # NaN ranks last
        live = list(valid)
        tot = F32(0.0)
        for k in range_constexpr(K):
            bk = F32(NEG_INF)
            bi = I32(E)  # "no candidate": loses to any real id, even at -inf
            bs = F32(0.0)
            for i in range_constexpr(EPT):
                take = live[i] & better(key[i], eid[i], bk, bi)
                bk = take.select(key[i], bk)
                bi = take.select(eid[i], bi)
                bs = take.select(sig[i], bs)
            for sh in range_constexpr(int(math.log2(WAVE))):
                off = (WAVE // 2) >> sh
                ok_ = bk.shuffle_xor(off, WAVE)
                oi = bi.shuffle_xor(off, WAVE)
                os_ = bs.shuffle_xor(off, WAVE)
                take = better(ok_, oi, bk, bi)
                bk = take.select(ok_, bk)
                bi = take.select(oi, bi)
                bs = take.select(os_, bs)
            lkey[wave] = bk
            lidx[wave] = bi
            lsig[wave] = bs
            gpu.barrier()
            bk = lkey[0]
            bi = lidx[0]
            bs = lsig[0]
            for w in range_constexpr(1, NWAVES):
                take = better(lkey[w], lidx[w], bk, bi)
                bk = take.select(lkey[w], bk)
                bi = take.select(lidx[w], bi)
                bs = take.select(lsig[w], bs)
            gpu.barrier()
            live = [live[i] & (eid[i] != bi) for i in range_constexpr(EPT)]
            sk = fx.math.isnan(bs).select(0.0, bs)  # a NaN σ counts as 0
            tot = tot + sk  # summed in pick order
            if tid == 0:
                IDS[t, k] = bi
                TW[t, k] = sk  # raw σ for now; normalized below by the same thread
        if tid == 0:
            for k in range_constexpr(K):
                TW[t, k] = TW[t, k] / tot

    @flyc.jit
    def launch(LG: fx.Tensor, BIAS: fx.Tensor, IDS: fx.Tensor, TW: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        kern(LG, BIAS, IDS, TW).launch(grid=(S, 1, 1), block=(T, 1, 1), stream=stream)

    return launch


def _unpacked_dot(words, xs, fmt: str):
    """Σ_j x_j·c_j over one 32-block: `words` = 4 Uint32 of 16 packed bytes (word wi,
    nibble n holds k = 8·wi + n), xs = 32 fp32 activations. c_j = E2M1 value (mxfp4)
    or u - 8 (int4); the block's scale is applied by the caller."""
    acc = F32(0.0)
    for wi in range(4):
        for n in range(8):
            code = (words[wi] >> (4 * n)) & 15
            if fmt in E2M1_WEIGHTS:
                c = e2m1_value(code)
            else:
                c = code.to(F32) - 8.0
            acc = acc + xs[8 * wi + n] * c
    return acc


def _scale_value(ws, fmt: str):
    if fmt in E2M1_WEIGHTS:
        return e8m0_value(U32((ws.to(I32) & 0xFF)))
    return f32(ws)  # int4: bf16 scale


@dataclass(frozen=True)
class MoeSpec:
    """Routed-expert GEMMs over one expert format. up: gu[p, n] = Σ_l a[t, l]·w13[e, n, l]
    (N = 2RI, K = LAT); down: y[t, n] = bf16-sum over picks of bf16(w_k·Σ_i v[p, i]·w2[e, n, i])
    (N = LAT, K = RI)."""

    stage: str  # "up" | "down"
    fmt: str  # "bf16" | "mxfp4" | "int4" | "a8w4"
    S: int
    TOPK: int
    N: int
    K: int
    rpg: int = 1
    waves: int = 4

    @property
    def chunk(self) -> int:  # k values per 16 weight bytes
        return VEC if self.fmt == "bf16" else QB

    @property
    def lpr(self) -> int:
        return _pow2_at_least(self.K // self.chunk)

    @property
    def rows_per_block(self) -> int:
        return self.waves * (WAVE // self.lpr) * self.rpg

    @property
    def grid_x(self) -> int:
        return _cdiv(self.N, self.rows_per_block)


def _moe_row_dot(spec: MoeSpec, X, xrow, W, WS, e, row, klane):
    """One lane's partial Σ_k x[xrow, k]·w[e, row, k] over its chunks (fp32)."""
    fmt, K, LPR, CH = spec.fmt, spec.K, spec.lpr, spec.chunk
    nchunks = K // CH
    iters = _cdiv(nchunks, LPR)
    x_is_f32 = spec.stage == "down" or fmt in ACT_QUANT
    xvec = 4 if x_is_f32 else VEC
    xatom = copy_atom(F32 if x_is_f32 else BF16)
    xch = row_chunks(X, (xrow, None), xvec)
    if fmt == "bf16":
        watom = copy_atom(BF16)
        wch = row_chunks(W, (e, row, None), VEC)
    else:
        watom = copy_atom(U8)
        wch = row_chunks(W, (e, row, None), 16)
    acc = F32(0.0)
    for it in range(iters):
        c = klane + LPR * it
        partial = (it == iters - 1) and (nchunks % LPR != 0)
        valid = c < nchunks
        cs = valid.select(c, 0) if partial else c
        xs = []
        for m in range(CH // xvec):
            xs += [xv for xv in _vec_elems(f32(load_chunk(xch, cs * (CH // xvec) + m, xvec,
                                                            F32 if x_is_f32 else BF16, xatom)), xvec)]
        if fmt == "bf16":
            wv = f32(load_chunk(wch, cs, VEC, BF16, watom))
            d = F32(0.0)
            for e_ in range(VEC):
                d = d + xs[e_] * wv[e_]
        else:
            words = load_chunk(wch, cs, 16, U8, watom).bitcast(U32)
            wl = [U32(words[i]) for i in range(4)]
            d = _unpacked_dot(wl, xs, fmt) * _scale_value(WS[e, row, cs], fmt)  # per-block dot, then scale
        if partial:
            d = valid.select(d, 0.0)
        acc = acc + d
    return acc


def _vec_elems(v, n):
    return [v[i] for i in range(n)]


@functools.lru_cache(maxsize=None)
def moe(spec: MoeSpec):
    """up:   launch(A [S, LAT] (bf16; fp32 MXFP4 / MXFP8 values for mxfp4 / a8w4), IDS [S, K] i32, TW (unused),
                    W13, W13S, GU [S·K, 2RI] f32, stream); grid (row tiles, picks)
    down: launch(V [S·K, RI] f32, IDS, TW [S, K] f32, W2, W2S, Y [S, LAT] bf16, stream);
          grid (row tiles, tokens); the picks are added in top-k order."""
    S, KT, N, RPG, LPR = spec.S, spec.TOPK, spec.N, spec.rpg, spec.lpr
    G = WAVE // LPR
    if spec.K % spec.chunk:
        raise ValueError(f"moe {spec.stage}: K={spec.K} is not a multiple of {spec.chunk}")
    name = kernel_name(f"moe_{spec.stage}_{spec.fmt}", spec)
    split = LY.lane_split(LPR)
    picks = LY.pick(KT, S)
    UP = spec.stage == "up"

    @flyc.kernel(name=name)
    def kern(X: fx.Tensor, IDS: fx.Tensor, TW: fx.Tensor, W: fx.Tensor, WS: fx.Tensor, OUT: fx.Tensor):
        tid = gpu.thread_idx.x
        lane = tid % WAVE
        wave = tid // WAVE
        klane, grp = LY.coord_of(split, lane)
        row0 = ((gpu.block_idx.x * spec.waves + wave) * G + grp) * RPG
        rows = [row0 + j for j in range_constexpr(RPG)]
        rowc = [(rows[j] < N).select(rows[j], N - 1) for j in range_constexpr(RPG)]
        if const_expr(UP):
            p = gpu.block_idx.y
            kk, t = LY.coord_of(picks, p)
            e = IDS[t, kk]
            vals = [wave_sum(_moe_row_dot(spec, X, t, W, WS, e, rowc[j], klane), LPR) for j in range_constexpr(RPG)]
            if klane == 0:
                for j in range_constexpr(RPG):
                    if rows[j] < N:
                        OUT[p, rows[j]] = vals[j]  # gemm1 stays fp32
        else:
            t = gpu.block_idx.y
            y = [F32(0.0) for _ in range_constexpr(RPG)]
            for kk in range_constexpr(KT):
                e = IDS[t, kk]
                wk = TW[t, kk]
                prow = LY.at(picks, (kk, t))
                for j in range_constexpr(RPG):
                    acc = wave_sum(_moe_row_dot(spec, X, prow, W, WS, e, rowc[j], klane), LPR)
                    contrib = rbf(acc * wk)  # contrib = bf16(acc·w_k)
                    y[j] = rbf(y[j] + contrib)  # y = bf16(y + contrib), in top-k order
            if klane == 0:
                for j in range_constexpr(RPG):
                    if rows[j] < N:
                        OUT[t, rows[j]] = bf16(y[j])

    @flyc.jit
    def launch(X: fx.Tensor, IDS: fx.Tensor, TW: fx.Tensor, W: fx.Tensor, WS: fx.Tensor, OUT: fx.Tensor,
               stream: fx.Stream = fx.Stream(None)):
        kern(X, IDS, TW, W, WS, OUT).launch(grid=(spec.grid_x, S * KT if UP else S, 1),
                                           block=(spec.waves * WAVE, 1, 1), stream=stream)

    return launch


@dataclass(frozen=True)
class ActSpec:
    """Routed SiTU per pick row: v = SiTU(g, u) in fp32, then quantize-dequantize per 32 to
    MXFP4 (mxfp4) or MXFP8 (a8w4), or a bf16 rounding (int4, bf16); stored as fp32 values."""

    fmt: str
    P: int  # picks S·K
    RI: int
    beta: float
    lam: float
    threads: int = 64


@functools.lru_cache(maxsize=None)
def act(spec: ActSpec):
    """launch(GU [P, 2RI] f32, V [P, RI] f32, stream). Thread = one 32-block of v."""
    P, RI, T = spec.P, spec.RI, spec.threads
    NBLK = RI // QB
    if RI % QB:
        raise ValueError(f"act: RI={RI} is not a multiple of {QB}")
    name = kernel_name(f"act_{spec.fmt}", spec)

    @flyc.kernel(name=name)
    def kern(GU: fx.Tensor, V: fx.Tensor):
        p = gpu.block_idx.x
        tid = gpu.thread_idx.x
        for m in range_constexpr(_cdiv(NBLK, T)):
            b = tid + T * m
            ok = b < NBLK
            bc = ok.select(b, 0)
            vs = [situ(GU[p, bc * QB + i], GU[p, RI + bc * QB + i], spec.beta, spec.lam)
                  for i in range_constexpr(QB)]
            if const_expr(spec.fmt in ACT_QUANT):
                vs = ACT_QUANT[spec.fmt](vs)  # a4w4 / a8w4: v quantized per 32, never rounded to bf16
            else:
                vs = [rbf(x) for x in vs]  # a16w4 / bf16: v rounded to bf16
            if ok:
                for i in range_constexpr(QB):
                    V[p, b * QB + i] = vs[i]

    @flyc.jit
    def launch(GU: fx.Tensor, V: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        kern(GU, V).launch(grid=(P, 1, 1), block=(T, 1, 1), stream=stream)

    return _min_waves(launch, 4)


@dataclass(frozen=True)
class EwSpec:
    """Row-wise elementwise ops on [S, N]:
    copy: OUT = A (bf16)            round: OUT = bf16(A) (fp32 in)
    mxq:  OUT = MXFP4 fake-quant of A per 32 (bf16 in, fp32 out)
    mx8q: OUT = MXFP8 (E4M3) fake-quant of A per 32 (bf16 in, fp32 out)
    situ: OUT[:, i] = bf16(SiTU(A[:, i], A[:, N + i])) (bf16 gate|up in)
    rms:  OUT = bf16(a·rsqrt(mean(a²) + eps)·W), a = bf16(A) (fp32 in)"""

    op: str
    S: int
    N: int
    eps: float = 0.0
    beta: float = 0.0
    lam: float = 0.0
    threads: int = 256


@functools.lru_cache(maxsize=None)
def ew(spec: EwSpec):
    """launch(A, W (rms only; else any tensor), OUT, stream); one block per row."""
    S, N, T, op = spec.S, spec.N, spec.threads, spec.op
    NWAVES = T // WAVE
    unit = QB if op in ("mxq", "mx8q") else 1
    NU = N // unit
    UPT = _cdiv(NU, T)
    if N % unit:
        raise ValueError(f"ew {op}: N={N} is not a multiple of {unit}")
    name = kernel_name(f"ew_{op}", spec)

    @fx.struct
    class Smem:
        red: fx.Array[F32, NWAVES, 16]

    @flyc.kernel(name=name)
    def kern(A: fx.Tensor, W: fx.Tensor, OUT: fx.Tensor):
        t = gpu.block_idx.x
        tid = gpu.thread_idx.x
        wave = tid // WAVE
        lds = fx.SharedAllocator().allocate(Smem).peek()
        red = lds.red.view(fx.make_layout(NWAVES, 1))
        us = [tid + T * m for m in range_constexpr(UPT)]
        ok = [us[m] < NU for m in range_constexpr(UPT)]
        uc = [ok[m].select(us[m], 0) for m in range_constexpr(UPT)]
        if const_expr(op == "copy"):
            for m in range_constexpr(UPT):
                if ok[m]:
                    OUT[t, us[m]] = A[t, us[m]]
        if const_expr(op == "round"):
            for m in range_constexpr(UPT):
                if ok[m]:
                    OUT[t, us[m]] = bf16(A[t, us[m]])  # the final reduce's one rounding
        if const_expr(op == "situ"):
            for m in range_constexpr(UPT):
                h = bf16(situ(f32(A[t, uc[m]]), f32(A[t, N + uc[m]]), spec.beta, spec.lam))  # h = bf16(SiTU)
                if ok[m]:
                    OUT[t, us[m]] = h
        if const_expr(op in ("mxq", "mx8q")):
            for m in range_constexpr(UPT):
                xs = EW_QUANT[op]([f32(A[t, uc[m] * QB + i]) for i in range_constexpr(QB)])
                if ok[m]:
                    for i in range_constexpr(QB):
                        OUT[t, us[m] * QB + i] = xs[i]
        if const_expr(op == "rms"):
            xs = [rbf(A[t, uc[m]]) for m in range_constexpr(UPT)]  # Ls = bf16(Σ_r y_r)
            sq = F32(0.0)
            for m in range_constexpr(UPT):
                sq = sq + ok[m].select(xs[m] * xs[m], 0.0)
            ms = block_sums([sq], red, wave, NWAVES)[0]
            rn = rsqrt(ms / float(N) + spec.eps)
            for m in range_constexpr(UPT):
                y = bf16(xs[m] * rn * f32(W[uc[m]]))  # the norm's one rounding
                if ok[m]:
                    OUT[t, us[m]] = y

    @flyc.jit
    def launch(A: fx.Tensor, W: fx.Tensor, OUT: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        kern(A, W, OUT).launch(grid=(S, 1, 1), block=(T, 1, 1), stream=stream)

    return launch
