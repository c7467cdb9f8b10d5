"""Device-side building blocks, traced into the kernels of kernels.py.

Everything here runs at trace time inside a `@flyc.kernel` body and emits IR; none
of it branches on run-time values (module-level helpers are not AST-rewritten), so
conditional work uses `select`. fp32 throughout; bf16 only where a caller rounds.
"""
from __future__ import annotations

import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr
from flydsl.expr import math as fmath

WAVE = 64  # gfx942 and gfx950 run wave64
F32, BF16, U32, I32, U8 = fx.Float32, fx.BFloat16, fx.Uint32, fx.Int32, fx.Uint8
NEG_INF = float("-inf")


def f32(x):
    return x.to(F32)


def bf16(x):
    """Round an fp32 value to bf16 (LLVM fptrunc: round-to-nearest-even)."""
    return x.to(BF16)


def rbf(x):
    """bf16(x) kept as its fp32 value (for chains of rounded fp32 sums)."""
    return x.to(BF16).to(F32)


def sigmoid(x):
    return 1.0 / (1.0 + fmath.exp(-x))


def silu(x):
    return x / (1.0 + fmath.exp(-x))


def tanh(x):
    """fp32 tanh without a libcall (the AMDGPU backend has none): an odd Taylor
    polynomial for |x| < 1/8 (truncation < 4e-9 relative), (1-e)/(1+e) with
    e = exp(-2|x|) above it."""
    a = fmath.absf(x)
    e = fmath.exp(a * -2.0)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    big = (x < 0.0).select(-big, big)
    return (a < 0.125).select(small, big)


def situ(g, u, beta: float, lam: float):
    """SiTU(g, u) = β·tanh(g/β)·sigmoid(g) · λ·tanh(u/λ) in fp32."""
    return (tanh(g / beta) * beta) * sigmoid(g) * (tanh(u / lam) * lam)


def rsqrt(x):
    return fmath.rsqrt(x)


# ------------------------------------------------------------ reductions

def wave_sum(x, width: int = WAVE):
    """xor butterfly over `width` adjacent lanes; every lane ends with the same bits
    (IEEE addition is commutative, so both partners of a pair add the same operands)."""
    off = width // 2
    while off >= 1:
        x = x + x.shuffle_xor(off, WAVE)
        off //= 2
    return x


def block_sums(vals: list, red, wave, nwaves: int) -> list:
    """Block-wide sums of several fp32 values: butterfly per wave, then the per-wave
    totals summed in wave order from LDS `red` (≥ nwaves·len(vals) floats). Every
    lane of a wave stores the same value to the same slot (a benign race)."""
    n = len(vals)
    ws = [wave_sum(v) for v in vals]
    if nwaves == 1:
        return ws
    for i, v in enumerate(ws):
        red[wave * n + i] = v
    gpu.barrier()
    out = []
    for i in range(n):
        acc = red[i]
        for w in range_constexpr(1, nwaves):
            acc = acc + red[w * n + i]
        out.append(acc)
    gpu.barrier()  # the slots may be reused by the next reduction
    return out


# ------------------------------------------------------------ loads

def row_chunks(t, row_coord: tuple, vec: int):
    """View of one row of `t` (coords with None for the row dim) split into
    chunks of `vec` contiguous elements: chunk i = elements [i·vec, (i+1)·vec)."""
    return fx.logical_divide(fx.slice(t, row_coord), fx.make_layout(vec, 1))


def load_chunk(chunks, i, vec: int, dtype, atom):
    r = fx.make_rmem_tensor(vec, dtype)
    fx.copy(atom, fx.slice(chunks, (None, i)), r)
    return fx.memref_load_vec(r)


def copy_atom(dtype):
    return fx.make_copy_atom(fx.UniversalCopy128b(), dtype)


# ------------------------------------------------------------ formats (DESIGN §7)

def e2m1_value(code):
    """E2M1 code (Uint32, 0..15) -> fp32, built from bits: magnitudes
    {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign."""
    m = code & 7
    bits = (((m >> 1) + 126) << 23) | ((m & 1) << 22)
    bits = (m == 1).select(U32(0x3F000000), bits)
    bits = (m == 0).select(U32(0), bits)
    return (bits | ((code & 8) << 28)).bitcast(F32)


def e8m0_value(s):
    """E8M0 scale byte (Uint32) -> 2^(s-127) in fp32; 0 is the subnormal 2^-127, 255 NaN."""
    bits = s << 23
    bits = (s == 0).select(U32(0x00400000), bits)
    bits = (s == 255).select(U32(0x7FC00000), bits)
    return bits.bitcast(F32)


def pow2_neg(code):
    """2^(127 - code) for an E8M0 code 0..254 (exact; 2^-127 is subnormal)."""
    e = 254 - code
    bits = (e == 0).select(U32(0x00400000), e << 23)
    return bits.bitcast(F32)


_MID = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)  # ties to the even code


def e2m1_code(y):
    """fp32 -> E2M1 code (Uint32), round-to-nearest-even, saturating at ±6."""
    a = fmath.absf(y)
    code = U32(0)
    for mid, up in zip(_MID, _TIE_UP):
        hit = (a >= mid) if up else (a > mid)
        code = code + hit.select(U32(1), U32(0))
    return code | (y < 0.0).select(U32(8), U32(0))


def mx_scale_code(amax):
    """E8M0 code of the power-of-two ceiling of amax/6 (DESIGN §7), ≤ 254."""
    bits = (amax * (1.0 / 6.0)).bitcast(U32)  # amax/6 rounded to fp32 once, as the reference
    code = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).select(U32(1), U32(0))
    return (code > 254).select(U32(254), code)


def mx_fake_quant32(xs: list) -> list:
    """32 fp32 values -> their MXFP4 quantize-dequantize values (exact in fp32)."""
    amax = fmath.absf(xs[0])
    for v in xs[1:]:
        amax = fx.max(amax, fmath.absf(v))
    code = mx_scale_code(amax)
    inv, scale = pow2_neg(code), e8m0_value(code)
    return [e2m1_value(e2m1_code(v * inv)) * scale for v in xs]


# a8w4 activations: MXFP8 = FP8 E4M3 (fn) elements with an E8M0 scale per 32 (DESIGN §7),
# the rule of ref/quant.py mx8_fake_quant

_E4M3_MIN_EXP = 121  # fp32 exponent field of 2^-6, E4M3's smallest normal binade
E4M3_MAX = 448.0


def e4m3_value(y):
    """fp32 -> the nearest FP8 E4M3 (fn) value, as fp32: ties to even, saturating at ±448.

    From 2^-6 up (E4M3 normals) the fp32 mantissa is rounded to 3 bits on the bits
    (add half an E4M3 ulp less one, plus the kept lsb; clear the 20 dropped bits: a carry
    moves into the exponent); below, the quantum is the subnormal 2^-9 and a·2^9 is
    rounded to an integer (roundeven). Both exact."""
    a = fmath.absf(y)
    bits = a.bitcast(U32)
    rn = ((bits + (U32(0x7FFFF) + ((bits >> 20) & 1))) & U32(0xFFF00000)).bitcast(F32)
    rs = fmath.roundeven(a * 512.0) * (1.0 / 512.0)
    r = (bits < (_E4M3_MIN_EXP << 23)).select(rs, rn)
    r = (r > E4M3_MAX).select(F32(E4M3_MAX), r)
    return fmath.copysign(r, y)


def mx8_scale_code(amax):
    """E8M0 code of an MXFP8 block (OCP MX: floor(log2 amax) - 8, the E4M3 emax): the fp32
    exponent field of amax minus 8, 0 when that is negative (amax = 0 included)."""
    e = (amax.bitcast(U32) >> 23) & 0xFF
    return (e < 8).select(U32(0), e - 8)


def mx8_fake_quant32(xs: list) -> list:
    """32 fp32 values -> their MXFP8 quantize-dequantize values (exact in fp32)."""
    amax = fmath.absf(xs[0])
    for v in xs[1:]:
        amax = fx.max(amax, fmath.absf(v))
    code = mx8_scale_code(amax)
    inv, scale = pow2_neg(code), e8m0_value(code)
    return [e4m3_value(v * inv) * scale for v in xs]
