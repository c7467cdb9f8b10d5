"""The FlyDSL device helpers (fast/flydsl/device.py) evaluated on the CPU: each helper traces
its IR on constant inputs inside a function, MLIR's canonicalizer folds that IR to
constants (IEEE arithmetic through APFloat, integer ops exactly), and the folded values
are compared with ml_dtypes and the reference's quantizers (ref/quant.py).

This checks the very IR the kernels are built from (bit tricks, selects, rounding
modes), not the GPU's instructions: the folder's exp/tanh are the host's libm, not
v_exp_f32, so transcendental helpers are checked against a tolerance only. Plus the
occupancy rule of fast/flydsl/occupancy.py on cases worked from LLVM's AMDGPU backend."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.cpu

pytest.importorskip("flydsl", reason="flydsl not installed")
ml_dtypes = pytest.importorskip("ml_dtypes")

from fast.flydsl import device as D  # noqa: E402
from fast.flydsl.occupancy import occupancy  # noqa: E402
from ref import quant as Q  # noqa: E402


def fold(fn, inputs: list, in_type: str = "f32", out_type: str = "f32") -> list:
    """fn(list of DSL constants) -> list of DSL values, folded to Python numbers."""
    from flydsl._mlir import ir
    from flydsl._mlir.dialects import func
    from flydsl._mlir.passmanager import PassManager
    from flydsl.compiler.jit_function import _create_mlir_context
    from flydsl.expr.typing import as_ir_value

    mk = D.F32 if in_type == "f32" else D.U32
    with _create_mlir_context(), ir.Location.unknown():
        mod = ir.Module.create()
        with ir.InsertionPoint(mod.body):
            ty = ir.F32Type.get() if out_type == "f32" else ir.IntegerType.get_signless(32)
            f = func.FuncOp("f", ir.FunctionType.get([], [ty] * len(inputs)))
            with ir.InsertionPoint(f.add_entry_block()):
                outs = fn([mk(float(v) if in_type == "f32" else int(v)) for v in inputs])
                assert len(outs) == len(inputs)
                func.ReturnOp([as_ir_value(o) for o in outs])
        PassManager.parse("builtin.module(canonicalize)").run(mod.operation)
        ret = list(f.entry_block.operations)[-1]
        vals = []
        for v in ret.operands:
            op = v.owner
            assert op.name == "arith.constant", f"not folded to a constant: {op}"
            attr = op.attributes["value"]
            vals.append(ir.FloatAttr(attr).value if out_type == "f32" else ir.IntegerAttr(attr).value & 0xFFFFFFFF)
    return vals


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _same(got, want):
    """Bitwise equal as fp32 (NaN matches NaN)."""
    g, w = _f32(got), _f32(want)
    assert g.shape == w.shape
    bad = ~((g.view(np.uint32) == w.view(np.uint32)) | (np.isnan(g) & np.isnan(w)))
    assert not bad.any(), [(float(a), float(b)) for a, b in zip(g[bad][:8], w[bad][:8])]


def _draw_blocks(rng: torch.Generator, nblocks: int) -> torch.Tensor:
    """[nblocks, 32] fp32 activations over many binades, with a zero block, an outlier
    block and exact ties of the E2M1 / E4M3 grids."""
    mag = torch.exp2(torch.randint(-20, 20, (nblocks, 1), generator=rng).float())
    x = torch.randn(nblocks, 32, generator=rng) * mag
    x[0] = 0.0
    x[1, 5] = 1e4 * float(mag[1])
    x[2] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * (1 - 2 * (torch.arange(32) % 2))
    # amax 256: scale 2^0, so these are E4M3 ties as they stand (17 -> 16, 19 -> 20, 1.5·2^-9 -> 2^-8)
    x[3] = torch.tensor([256.0, 17.0, 19.0, 1.0625, 1.1875, -17.0, 3 * 2.0 ** -10, 2.0 ** -7 * 1.0625] * 4)
    return x


# ---------------------------------------------------------------- E2M1 / E8M0 (MXFP4)

def test_e2m1_value_every_code():
    got = fold(lambda cs: [D.e2m1_value(c) for c in cs], list(range(16)), in_type="u32")
    want = ml_dtypes.float4_e2m1fn
    codes = np.arange(16, dtype=np.uint8)
    ref = [float(np.frombuffer(bytes([c]), dtype=np.uint8).view(want)[0]) for c in codes]
    _same(got, ref)
    _same(got, Q.e2m1_decode(torch.arange(16, dtype=torch.uint8)).numpy())


def test_e8m0_and_pow2():
    codes = [0, 1, 2, 100, 126, 127, 128, 200, 253, 254, 255]
    got = fold(lambda cs: [D.e8m0_value(c) for c in cs], codes, in_type="u32")
    _same(got, Q.e8m0_decode(torch.tensor(codes, dtype=torch.uint8)).numpy())
    inv = fold(lambda cs: [D.pow2_neg(c) for c in cs], codes[:-1], in_type="u32")
    _same(inv, np.exp2(127.0 - np.array(codes[:-1], dtype=np.float64)).astype(np.float32))


def test_e2m1_code_against_reference(rng):
    ys = torch.cat([torch.tensor([0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 100.0, -0.75, -5.0]),
                    torch.randn(50, generator=rng) * 3])
    got = fold(lambda v: [D.e2m1_code(y) for y in v], ys.tolist(), out_type="u32")
    want = Q.e2m1_encode(ys).to(torch.int64).tolist()
    # -0.0 is encoded with its sign bit by neither side: y < 0 is False for -0.0
    assert got == want


def test_mx_fake_quant32_against_reference(rng):
    x = _draw_blocks(rng, 8)
    for blk in x:
        got = fold(D.mx_fake_quant32, blk.tolist())
        _same(got, Q.mx_fake_quant(blk[None].float())[0].numpy())


# ---------------------------------------------------------------- E4M3 / MXFP8 (a8w4)

def test_e4m3_value_against_ml_dtypes(rng):
    special = [0.0, 1.0, -1.0625, 1.1875, 17.0, 19.0, 0.0146, 2.0 ** -7 * 1.0625, 2.0 ** -9, 2.0 ** -10,
               2.0 ** -10 * 1.5, 3 * 2.0 ** -10, 2.0 ** -6 * 0.9375, 240.0, 248.0, 440.0, 448.0, 460.0, 464.0,
               470.0, 500.0, 1e-30, -3.3]
    ys = _f32(special + (torch.randn(80, generator=rng) * torch.exp2(torch.randint(-12, 9, (80,),
                                                                                   generator=rng).float())).tolist())
    got = fold(lambda v: [D.e4m3_value(y) for y in v], ys.tolist())
    want = np.clip(ys, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)  # saturating
    _same(np.abs(got), np.abs(want))  # ml_dtypes keeps -0.0 where a negative value rounds to 0, so do we
    _same(got, want)
    _same(got, Q.e4m3_round(torch.from_numpy(ys)).numpy())


def test_mx8_scale_code_against_reference(rng):
    amax = _f32([0.0, 1e-40, 2.0 ** -119, 2.0 ** -118, 1.0, 255.0, 256.0, 448.0, 3e38]
                + torch.rand(20, generator=rng).mul(1e3).tolist())
    got = fold(lambda v: [D.mx8_scale_code(a) for a in v], amax.tolist(), out_type="u32")
    assert got == Q.mx8_scale_code(torch.from_numpy(amax)).to(torch.int64).tolist()


def test_mx8_fake_quant32_against_reference_and_ml_dtypes(rng):
    x = _draw_blocks(rng, 10)
    for blk in x:
        got = fold(D.mx8_fake_quant32, blk.tolist())
        _same(got, Q.mx8_fake_quant(blk[None].float())[0].numpy())
        # independently: scale 2^(floor(log2 amax) - 8), elements through ml_dtypes' E4M3
        amax = float(blk.abs().max())
        e = 0 if amax == 0 else max(0, math.frexp(amax)[1] - 1 - 8 + 127)
        scaled = _f32(blk.double().numpy() * 2.0 ** (127 - e))
        want = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** (e - 127)
        _same(got, want.astype(np.float32))


# ---------------------------------------------------------------- SiTU (formula only)

def test_tanh_and_situ_formula(rng):
    xs = torch.cat([torch.tensor([0.0, 1e-4, 0.1, 0.124, 0.126, 0.5, -0.7, 3.0, -9.0, 20.0]),
                    torch.randn(40, generator=rng) * 4]).double()
    got = torch.tensor(fold(lambda v: [D.tanh(x) for x in v], xs.tolist()), dtype=torch.float64)
    assert torch.allclose(got, torch.tanh(xs), rtol=3e-7, atol=1e-9)
    g, u = xs[:25], xs[25:]
    got = torch.tensor(fold(lambda v: [D.situ(a, b, 4.0, 25.0) for a, b in zip(v[:25], v[25:])] * 2,
                            g.tolist() + u.tolist())[:25], dtype=torch.float64)
    want = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    assert torch.allclose(got, want, rtol=2e-6, atol=1e-7)


# ---------------------------------------------------------------- occupancy

@pytest.mark.parametrize("arch,vgpr,sgpr,lds,wg,want", [
    ("gfx942", 238, 20, 0, 256, (2, "vgpr")),  # the k3-tp8 GEMVs before this change
    ("gfx950", 128, 20, 0, 256, (4, "vgpr")),
    ("gfx942", 129, 20, 0, 256, (3, "vgpr")),
    ("gfx942", 86, 22, 256, 256, (5, "vgpr")),
    ("gfx942", 64, 20, 0, 256, (8, "max")),
    ("gfx942", 65, 20, 0, 256, (7, "vgpr")),
    ("gfx942", 44, 20, 0, 64, (8, "max")),  # LLVM agpr-register-count.ll: 9 VGPRs + 32 AGPRs = 44 -> 8
    ("gfx942", 4, 20, 0, 64, (8, "max")),
    ("gfx942", 40, 101, 0, 256, (7, "sgpr")),
    ("gfx942", 40, 20, 40 * 1024, 256, (1, "lds")),  # one 40 KiB workgroup in 64 KiB
    ("gfx950", 40, 20, 40 * 1024, 256, (4, "lds")),  # four in 160 KiB
    ("gfx942", 94, 26, 164, 1024, (4, "vgpr")),  # 5 waves fit per SIMD, a 16-wave workgroup takes 4
    ("gfx942", 130, 26, 164, 1024, (0, "vgpr")),  # a 1024-thread workgroup needs ≤ 128 VGPRs
    ("gfx942", 20, 20, 0, 1024, (8, "max")),
    ("gfx942", 20, 20, 0, 128, (8, "max")),
    ("gfx942", 20, 20, 0, 576, (6, "wg")),  # 9-wave workgroups: 32 // 9 = 3 per CU, 27 waves
])
def test_occupancy_rule(arch, vgpr, sgpr, lds, wg, want):
    assert occupancy(arch, vgpr, sgpr, lds, wg) == want
