"""Expert weight formats (DESIGN §7): E2M1 / E8M0 (MXFP4), unsigned int4, and the MXFP8
(E4M3 / E8M0) activations of a8w4.

Packed layout: two 4-bit codes per byte along the last dim, low nibble = even k.
"""
from __future__ import annotations

import torch

E2M1_MAG = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes, and whether a tie rounds up there:
# round-to-nearest-even on the code, so a tie goes to the even code.
_E2M1_MID = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)
QBLOCK = 32


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes 0..15 -> [..., K/2] uint8, low nibble = even k."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] uint8 codes."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


_LUTS: dict = {}


def _e2m1_lut(dtype, device) -> torch.Tensor:
    key = (dtype, str(device))
    if key not in _LUTS:
        _LUTS[key] = torch.tensor(E2M1_MAG + tuple(-m for m in E2M1_MAG), dtype=dtype, device=device)
    return _LUTS[key]


def e2m1_decode(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """uint8 codes 0..15 -> values; bit 3 is the sign."""
    return _e2m1_lut(dtype, codes.device)[codes.long()]


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even code), saturating at ±6 -> uint8 codes."""
    a = y.abs()
    key = ("mids", a.dtype, str(a.device))
    if key not in _LUTS:
        _LUTS[key] = tuple(torch.tensor([m for m, u in zip(_E2M1_MID, _E2M1_TIE_UP) if u == want], dtype=a.dtype,
                                        device=a.device) for want in (False, True))
    down, up = _LUTS[key]
    # midpoints passed: strictly (tie stays on the even code below) or at-or-above (even code above)
    code = torch.bucketize(a, down, right=False) + torch.bucketize(a, up, right=True)
    return code.to(torch.uint8) | ((y < 0).to(torch.uint8) << 3)


def e8m0_decode(scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """uint8 E8M0 -> 2^(s-127); 0xFF is NaN."""
    v = torch.exp2(scale.to(dtype) - 127.0)
    return torch.where(scale == 0xFF, torch.full_like(v, float("nan")), v)


def mx_scale_code(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 code of the power-of-two ceiling of amax/6 (DESIGN §7), clamped to ≤ 254.

    fp32 amax: the exponent field of bf32(amax·(1/6)), +1 when its mantissa is non-zero.
    f64 amax (oracle): the same ceiling taken exactly.
    """
    if amax.dtype == torch.float64:
        v = amax * (1.0 / 6.0)
        m, e = torch.frexp(v)  # v = m·2^e, m in [0.5, 1)
        code = torch.where(m == 0.5, e - 1, e) + 127
        code = torch.where(amax > 0, code, torch.zeros_like(code))
        return code.clamp(0, 254).to(torch.uint8)
    v = amax.float() * (1.0 / 6.0)  # rounds to fp32 once, as the kernels do
    bits = v.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    code = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return code.clamp(max=254).to(torch.uint8)


def mx_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., K] (K % 32 == 0) to MXFP4: codes [..., K] uint8, scales [..., K/32] uint8."""
    k = x.shape[-1]
    if k % QBLOCK:
        raise ValueError(f"mxfp4: K={k} is not a multiple of {QBLOCK}")
    xb = x.reshape(*x.shape[:-1], k // QBLOCK, QBLOCK)
    scale = mx_scale_code(xb.abs().amax(-1))
    inv = torch.exp2(127.0 - scale.to(xb.dtype))  # exact power of two
    codes = e2m1_encode(xb * inv.unsqueeze(-1))
    return codes.reshape(x.shape), scale


def mx_dequant(codes: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """codes [..., K], scales [..., K/32] -> values [..., K] (exact in fp32)."""
    k = codes.shape[-1]
    v = e2m1_decode(codes, dtype).reshape(*codes.shape[:-1], k // QBLOCK, QBLOCK)
    return (v * e8m0_decode(scale, dtype).unsqueeze(-1)).reshape(codes.shape)


def mx_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize an activation to MXFP4 per 32 (dtype of x kept)."""
    codes, scale = mx_quant(x)
    return mx_dequant(codes, scale, x.dtype)


E4M3_MAX = 448.0
E4M3_EMAX = 8  # floor(log2(448))
_E4M3_MIN_NORMAL_EXP = -6  # 2^-6; below it the E4M3 spacing is the subnormal 2^-9
_E4M3_MANT = 3


def mx8_scale_code(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 code of an MXFP8 (E4M3) block: OCP MX v1.0 §6.3, shared exponent
    floor(log2(amax)) - emax(E4M3) = floor(log2(amax)) - 8, clamped to [0, 254]; amax = 0
    (or below 2^-119) gives code 0. fp32 amax reads the exponent field; f64 (oracle) is exact."""
    if amax.dtype == torch.float64:
        _, e = torch.frexp(amax)  # amax = m·2^e, m in [0.5, 1): floor(log2 amax) = e - 1
        code = torch.where(amax > 0, e - 1 - E4M3_EMAX + 127, torch.zeros_like(e))
        return code.clamp(0, 254).to(torch.uint8)
    exp = (amax.float().view(torch.int32) >> 23) & 0xFF
    return (exp - E4M3_EMAX).clamp(0, 254).to(torch.uint8)


def e4m3_round(y: torch.Tensor) -> torch.Tensor:
    """Nearest FP8 E4M3 (fn) value, ties to even, saturating at ±448 (dtype of y kept, exact:
    the quantum is a power of two and y/quantum is rounded by torch.round, half to even)."""
    a = y.abs()
    _, e = torch.frexp(a)  # a = m·2^e: the binade of a is 2^(e-1)
    q_exp = torch.clamp(e - 1, min=_E4M3_MIN_NORMAL_EXP) - _E4M3_MANT
    quantum = torch.ldexp(torch.ones_like(a), q_exp)
    r = torch.round(a / quantum) * quantum
    return torch.copysign(torch.clamp(r, max=E4M3_MAX), y)


def mx8_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize an activation to MXFP8 (E4M3 elements, E8M0 scale per 32): the
    a8w4 activation quant (dtype of x kept; every result is exact in fp32)."""
    k = x.shape[-1]
    if k % QBLOCK:
        raise ValueError(f"a8w4: K={k} is not a multiple of {QBLOCK}")
    xb = x.reshape(*x.shape[:-1], k // QBLOCK, QBLOCK)
    code = mx8_scale_code(xb.abs().amax(-1)).to(xb.dtype).unsqueeze(-1)
    scale = torch.exp2(code - 127.0)  # exact power of two
    return (e4m3_round(xb * torch.exp2(127.0 - code)) * scale).reshape(x.shape)


def int4_dequant(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Unsigned nibbles u with bf16 scales per 32: (u - 8)·scale, exact in fp32."""
    u = unpack_nibbles(packed).to(dtype) - 8.0
    k = u.shape[-1]
    u = u.reshape(*u.shape[:-1], k // QBLOCK, QBLOCK)
    return (u * scale.to(dtype).unsqueeze(-1)).reshape(*packed.shape[:-1], k)


def int4_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [..., K] -> (packed uint8 [..., K/2], bf16 scales [..., K/32]).

    Scales keep 5 significant bits, so every (u-8)·scale is exact in bf16: a kernel
    that dequantizes to bf16 loses nothing.
    """
    k = w.shape[-1]
    wb = w.float().reshape(*w.shape[:-1], k // QBLOCK, QBLOCK)
    s = wb.abs().amax(-1) / 7.0
    m, e = torch.frexp(s.clamp_min(2.0 ** -100))
    s = torch.ldexp(torch.ceil(m * 32.0) / 32.0, e).to(torch.bfloat16)  # 5 bits, rounded up
    u = torch.clamp(torch.round(wb / s.float().unsqueeze(-1)) + 8.0, 0, 15).to(torch.uint8)
    return pack_nibbles(u.reshape(w.shape)), s


def dequant_experts(w: torch.Tensor, ws: torch.Tensor | None, fmt: str, dtype=torch.float32) -> torch.Tensor:
    """Logical [E, N, K] values of an expert weight in any format."""
    if fmt == "bf16":
        return w.to(dtype)
    if fmt in ("mxfp4", "a8w4"):
        return mx_dequant(unpack_nibbles(w), ws, dtype)
    if fmt == "int4":
        return int4_dequant(w, ws, dtype)
    raise ValueError(f"experts: unknown format {fmt!r}")


def quantize_experts(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 [E, N, K] -> (weights, scales) in the format's logical layout."""
    if fmt == "bf16":
        return w.to(torch.bfloat16), None
    if fmt in ("mxfp4", "a8w4"):
        codes, scale = mx_quant(w.float())
        return pack_nibbles(codes), scale
    if fmt == "int4":
        return int4_quant(w)
    raise ValueError(f"experts: unknown format {fmt!r}")
