"""Expert weight formats of DESIGN §7 (`ref.quant`) against ml_dtypes, the loops and hand values:
E2M1 encode/decode, E8M0, the MXFP4 activation quantizer (scale rule, RNE, saturation,
amax = 0), packed nibbles and int4 dequant."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import loops as lp
from ref import quant as q

pytestmark = pytest.mark.cpu

F4, E8 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e8m0fnu


def f4_values(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(F4).astype(np.float64)


def e8_values(scales: np.ndarray) -> np.ndarray:
    return scales.astype(np.uint8).view(E8).astype(np.float64)


# ---------------------------------------------------------------- E2M1

def test_e2m1_decode_all_codes():
    codes = np.arange(16, dtype=np.uint8)
    got = q.e2m1_decode(torch.from_numpy(codes)).numpy().astype(np.float64)
    want = f4_values(codes)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # code 8 is -0
    np.testing.assert_array_equal(got, [lp.e2m1_value(c) for c in range(16)])
    assert q.e2m1_decode(torch.from_numpy(codes), torch.float64).dtype == torch.float64


def _grid() -> np.ndarray:
    """Every multiple of 1/64 in [-8, 8], each E2M1 midpoint ± 1 fp32 ulp, big and tiny values."""
    base = np.arange(-512, 513, dtype=np.float64) / 64
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(10))])
    far = np.array([6.5, 7.0, 12.0, 1e6, 3e38, 1e-30, 1e-45], dtype=np.float32)
    v = np.concatenate([base, near, far]).astype(np.float32)
    v = np.concatenate([v, -v])
    return v[~((v == 0) & np.signbit(v))]  # -0.0: ml_dtypes keeps its sign bit, E2M1 encode gives +0


def test_e2m1_encode_vs_ml_dtypes():
    x = _grid()
    got = q.e2m1_encode(torch.from_numpy(x)).numpy()
    want = x.astype(F4).view(np.uint8)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"e2m1_encode differs from ml_dtypes at {x[bad[:5]]}: {got[bad[:5]]} vs {want[bad[:5]]}"
    np.testing.assert_array_equal(got, [lp.e2m1_code(float(v)) for v in x])


@pytest.mark.parametrize("value,code", [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),  # ties to even code
    (0.2500001, 1), (5.0001, 7), (0.24, 0), (2.6, 5),
    (6.0, 7), (6.1, 7), (7.0, 7), (1e30, 7),  # saturation at ±6
    (-0.75, 10), (-5.0, 14), (-1e30, 15), (0.0, 0),
])
def test_e2m1_encode_hand(value, code):
    got = int(q.e2m1_encode(torch.tensor([value], dtype=torch.float32))[0])
    assert got == code, f"E2M1({value}) = code {got}, expected {code}"


# ---------------------------------------------------------------- E8M0

def test_e8m0_decode_all_codes():
    s = np.arange(256, dtype=np.uint8)
    got = q.e8m0_decode(torch.from_numpy(s)).numpy().astype(np.float64)
    want = e8_values(s)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[255]) and np.isnan(got).sum() == 1, "only 0xFF is NaN"
    np.testing.assert_array_equal(got[:255], want[:255])
    g64 = q.e8m0_decode(torch.from_numpy(s), torch.float64).numpy()
    np.testing.assert_array_equal(g64[:255], [math.ldexp(1.0, int(c) - 127) for c in range(255)])


@pytest.mark.parametrize("amax,code", [
    (0.0, 0), (6.0, 127), (3.0, 126), (12.0, 128), (7.0, 128), (1.0, 125), (0.75, 124),
    (float(np.nextafter(np.float32(6.0), np.float32(7))), 128),
    (float(np.float32(3.4028235e38)), 253),  # fp32 max: 2^126 ≥ amax/6; the 254 clamp is out of reach
    (1e-40, 1),  # amax/6 is an fp32 subnormal: exponent field 0, mantissa non-zero
])
def test_mx_scale_code_hand(amax, code):
    got = int(q.mx_scale_code(torch.tensor([amax], dtype=torch.float32))[0])
    assert got == code, f"scale code of amax={amax}: {got}, expected {code}"
    assert lp.mx_scale(amax) == code


def test_mx_scale_code_vs_loop(rng):
    e = torch.randint(-140, 128, (4000,), generator=rng).double()
    m = 1 + torch.rand(4000, generator=rng, dtype=torch.float64)
    amax = torch.ldexp(m, e.long()).float()
    amax[:50] = torch.ldexp(torch.ones(50), torch.arange(-100, 150, 5)[:50]).float() * 6  # exact 6·2^k
    amax = amax[torch.isfinite(amax)]
    got = q.mx_scale_code(amax).tolist()
    want = [lp.mx_scale(float(a)) for a in amax]
    bad = [(float(a), g, w) for a, g, w in zip(amax, got, want) if g != w]
    assert not bad, f"{len(bad)} scale codes differ, e.g. {bad[:3]}"


def test_mx_scale_code_oracle_is_exact_ceiling():
    """float64 amax (oracle): the exact power-of-two ceiling of amax/6."""
    amax = torch.tensor([0.0, 6.0, 6.0 + 1e-12, 3.0, 1.0, 6.0 * 2.0 ** 40, 6.0 * 2.0 ** 40 * (1 + 2 ** -50)],
                        dtype=torch.float64)
    got = q.mx_scale_code(amax).tolist()
    assert got == [0, 127, 128, 126, 125, 167, 168]


# ---------------------------------------------------------------- MXFP4 activation quantizer

def _activation_blocks(g: torch.Generator) -> torch.Tensor:
    """[6, 128] fp32 rows: varied magnitudes, a zero block, a one-hot block, exact ties."""
    x = torch.randn(6, 128, generator=g) * torch.tensor([1.0, 1e-3, 37.0, 1e5, 1.0, 0.02])[:, None]
    x[0, 32:64] = 0.0  # amax = 0 -> scale 0, codes 0
    x[1, 0:32] = 0.0
    x[1, 5] = -2.5e-3
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[4, 64:96] = torch.cat([mids, -mids, mids * 0.5, -mids * 0.5])  # amax 6: scale 1, exact ties
    x[4, 96:128] = torch.cat([mids, -mids, mids, -mids]) * 8.0  # amax 48: scale 8
    return x.to(torch.bfloat16).float()  # activations arrive as bf16 values


def test_mx_quant_vs_loop(rng):
    x = _activation_blocks(rng)
    codes, scales = q.mx_quant(x)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.uint8 and scales.shape == (6, 4)
    for r in range(x.shape[0]):
        wc, ws = lp.mx_quant_vec(x[r].tolist())
        assert codes[r].tolist() == wc, f"row {r}: E2M1 codes differ"
        assert scales[r].tolist() == ws, f"row {r}: scales differ"
    assert scales[0, 1] == 0 and bool((codes[0, 32:64] == 0).all())
    assert scales[4, 2] == 127 and scales[4, 3] == 130
    # the ties of row 4 follow RNE on the code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert codes[4, 64:72].tolist() == [0, 2, 2, 4, 4, 6, 6, 7]
    deq = q.mx_dequant(codes, scales)
    want = f4_values(codes.numpy()).reshape(6, 4, 32) * e8_values(scales.numpy())[..., None]
    np.testing.assert_array_equal(deq.numpy().astype(np.float64), want.reshape(6, 128))
    np.testing.assert_array_equal(q.mx_fake_quant(x).numpy().astype(np.float64),
                                  np.stack([lp.mx_fake_quant_vec(r.tolist()) for r in x]))


def test_mx_quant_error_bound(rng):
    """Round to nearest: |x − Q(x)| ≤ half an E2M1 step of the block scale (step 2 near the top)."""
    x = torch.randn(64, 64, generator=rng) * 3
    codes, scales = q.mx_quant(x)
    s = q.e8m0_decode(scales).repeat_interleave(32, dim=1)
    err = (q.mx_dequant(codes, scales) - x).abs()
    assert bool((err <= s * 1.0 + 1e-30).all())
    assert bool((x.abs() <= 6 * s).all()), "power-of-two ceiling: every |x| ≤ 6·scale"


def test_mx_quant_rejects_ragged_k():
    with pytest.raises(ValueError, match="32"):
        q.mx_quant(torch.ones(2, 48))


def test_mx_quant_float64_path():
    """oracle inputs (float64) quantize with the same codes as fp32 for values exact in both."""
    x = _activation_blocks(torch.Generator().manual_seed(1))
    c32, s32 = q.mx_quant(x)
    c64, s64 = q.mx_quant(x.double())
    assert torch.equal(c32, c64) and torch.equal(s32, s64)
    assert q.mx_fake_quant(x.double()).dtype == torch.float64


# ---------------------------------------------------------------- packing, mxfp4 and int4 weights

def test_pack_nibbles_low_is_even(rng):
    codes = torch.randint(0, 16, (3, 64), generator=rng, dtype=torch.uint8)
    packed = q.pack_nibbles(codes)
    assert packed.shape == (3, 32)
    for r in range(3):
        for k in range(64):
            assert lp.nibble(packed[r].numpy(), k) == int(codes[r, k])
    assert torch.equal(q.unpack_nibbles(packed), codes)


def test_mxfp4_weights_vs_ml_dtypes(rng):
    packed = torch.randint(0, 256, (2, 5, 32), generator=rng, dtype=torch.uint8)
    scales = torch.randint(100, 150, (2, 5, 2), generator=rng, dtype=torch.uint8)
    scales[1, 3, 1] = 0xFF
    got = q.dequant_experts(packed, scales, "mxfp4").numpy().astype(np.float64)
    codes = np.stack([packed.numpy() & 0xF, packed.numpy() >> 4], axis=-1).reshape(2, 5, 64)
    want = f4_values(codes).reshape(2, 5, 2, 32) * e8_values(scales.numpy())[..., None]
    want = want.reshape(2, 5, 64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[1, 3, 32:]).all() and not np.isnan(got[1, 3, :32]).any(), "0xFF scale = NaN block"
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    np.testing.assert_array_equal(got[0, 2], lp.dequant_row(packed[0, 2], scales[0, 2], "mxfp4"))


def test_int4_dequant_vs_loop(rng):
    packed = torch.randint(0, 256, (2, 4, 32), generator=rng, dtype=torch.uint8)
    scales = (torch.rand(2, 4, 2, generator=rng) * 0.1 + 1e-3).to(torch.bfloat16)
    got = q.dequant_experts(packed, scales, "int4")
    assert got.shape == (2, 4, 64)
    for e in range(2):
        np.testing.assert_array_equal(got[e].numpy().astype(np.float64),
                                      lp.dequant_matrix(packed[e], scales[e], "int4"))
    # low nibble first; nibble 8 is zero, 0 is -8·s, 15 is 7·s
    p = torch.tensor([[0x80, 0xF0] * 16], dtype=torch.uint8)
    s = torch.tensor([[0.5, 2.0]], dtype=torch.bfloat16)
    v = q.int4_dequant(p, s)[0]
    assert v[:4].tolist() == [-4.0, 0.0, -4.0, 3.5] and v[32:36].tolist() == [-16.0, 0.0, -16.0, 14.0]
    p2 = torch.tensor([[0x0F] * 16], dtype=torch.uint8)
    assert q.int4_dequant(p2, torch.tensor([[1.0]], dtype=torch.bfloat16))[0, :2].tolist() == [7.0, -8.0]


def test_int4_quant_exact_in_bf16(rng):
    """int4_quant's scales keep 5 bits so every (u-8)·scale is exact in bf16; |w - deq| ≤ scale/2."""
    w = torch.randn(3, 8, 64, generator=rng) * 0.05
    packed, scales = q.int4_quant(w)
    assert packed.dtype == torch.uint8 and scales.dtype == torch.bfloat16 and scales.shape == (3, 8, 2)
    deq = q.int4_dequant(packed, scales)
    assert torch.equal(deq.to(torch.bfloat16).float(), deq)
    s = scales.float().repeat_interleave(32, dim=-1)
    assert bool(((deq - w).abs() <= s / 2 + 1e-9).all())


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "int4"])
def test_quantize_experts_roundtrip(rng, fmt):
    w = torch.randn(2, 8, 64, generator=rng) * 0.1
    wq, ws = q.quantize_experts(w, fmt)
    deq = q.dequant_experts(wq, ws, fmt)
    assert deq.shape == w.shape
    for e in range(2):
        np.testing.assert_array_equal(deq[e].numpy().astype(np.float64),
                                      lp.dequant_matrix(wq[e], None if ws is None else ws[e], fmt))
    rel = float((deq - w).norm() / w.norm())
    assert rel < {"bf16": 5e-3, "mxfp4": 0.2, "int4": 0.12}[fmt], rel
