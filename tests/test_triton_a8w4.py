"""Triton backend, interpreted (tiny config): the a8w4 expert format (DESIGN §7) — MXFP4
weights, `lat` and `v` quantized per 32 to FP8 E4M3 with an E8M0 scale.

- the device quantizer against ref.quant.mx8_fake_quant bit for bit, and against
  ml_dtypes.float8_e4m3fn for the element rounding (ties, saturation, subnormals);
- the routed-expert stage isolated: the reference stage fed the backend's own lat / picks /
  weights reproduces the backend's y bit for bit (and a kernel quantizing to MXFP4 instead
  would not);
- a chained replay of a tiny a8w4 capture set through the CLI passes.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from triton_tier import backend, triton, tune  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import triton.language as tl  # noqa: E402

import ref  # noqa: E402
from conftest import clone, make_k2  # noqa: E402
from fast.triton import _jit as fj  # noqa: E402
from ref import quant  # noqa: E402
from ref._num import Num  # noqa: E402
from ref.routed_experts import routed_experts  # noqa: E402

pytestmark = pytest.mark.interpret


@triton.jit
def _mx8_kernel(v_ptr, q_ptr, c_ptr, r_ptr, SP: tl.constexpr, BN: tl.constexpr):
    rs = tl.arange(0, SP)
    rn = tl.arange(0, BN)
    v = tl.load(v_ptr + rs[:, None] * BN + rn[None, :])
    q, code = fj.mx8_quant_rows(v, SP, BN)
    tl.store(q_ptr + rs[:, None] * BN + rn[None, :], q)
    tl.store(c_ptr + rs[:, None] * (BN // 32) + tl.arange(0, BN // 32)[None, :], code)
    tl.store(r_ptr + rs[:, None] * BN + rn[None, :], fj.e4m3_round(v))


def test_mx8_quant_matches_reference_and_ml_dtypes(backend, rng):
    SP, BN = 8, 128
    v = torch.randn(SP, BN, generator=rng) * torch.exp2(
        torch.randint(-20, 20, (SP, BN // 32), generator=rng).float()).repeat_interleave(32, 1)
    v[0, :32] = 0.0                                            # amax 0 -> code 0
    v[1, :32] = torch.linspace(-3, 3, 32)                      # several binades in one block
    grid = torch.tensor([1.0, 1.125, 1.25, 2.0, 2.25, 256.0, 288.0, 2.0 ** -7, 2.0 ** -9])
    v[2, :9] = grid + grid * 2.0 ** -5                          # halfway between E4M3 neighbours: ties
    v[2, 9:18] = -(grid * (1 + 2.0 ** -4))
    v[2, 18:32] = 0.01
    v[3, :32] = 500.0 * torch.rand(32, generator=rng)          # scaled amax in [256, 512): saturates at 448
    v[4, :32] = 2.0 ** -125 * torch.randn(32, generator=rng)   # fp32-subnormal-range block
    q, c, r = torch.empty(SP, BN), torch.empty(SP, BN // 32, dtype=torch.int32), torch.empty(SP, BN)
    for t in (q, r):
        t.fill_(float("nan"))
    _mx8_kernel[(1,)](v, q, c, r, SP=SP, BN=BN)
    want = quant.mx8_fake_quant(v)
    code = quant.mx8_scale_code(v.reshape(SP, BN // 32, 32).abs().amax(-1))
    assert torch.equal(c, code.to(torch.int32))
    deq = (q.reshape(SP, BN // 32, 32) * torch.exp2(c.float() - 127).unsqueeze(-1)).reshape(SP, BN)
    assert torch.equal(deq, want), "mx8 fake-quant differs from ref.quant.mx8_fake_quant"
    # element rounding alone (unscaled values that fit E4M3's range) against ml_dtypes
    inrange = v.abs() <= 448
    e4 = torch.from_numpy(v.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert torch.equal(r[inrange], e4[inrange])
    assert (r[~inrange].abs() == 448).all()


@pytest.mark.parametrize("fmt,layer,S", [("a8w4", 1, 6), ("a8w4", 2, 3), ("mxfp4", 1, 6)])
def test_routed_experts_isolated_bit_exact(backend, tune, seed, fmt, layer, S):
    key, ranks = make_k2(seed=seed, fmt=fmt, layer=layer, S=S)
    b = [dict(clone(r), taps={}) for r in ranks]
    for x in b:
        x["out"].fill_(float("nan"))
    ref.k2_world(key, b, launch=backend.k2_launch)
    for r, w in enumerate(ranks):
        tb = b[r]["taps"]
        want = routed_experts(tb["lat"], tb["topk_ids"], tb["topk_w"], w["w13"], w["w13s"], w["w2"], w["w2s"], fmt,
                              key.situ_beta, key.situ_linear_beta, Num())
        assert torch.equal(tb["y"], want), f"rank {r}: routed experts (isolated) differ"
        other = routed_experts(tb["lat"], tb["topk_ids"], tb["topk_w"], w["w13"], w["w13s"], w["w2"], w["w2s"],
                               "mxfp4" if fmt == "a8w4" else "a8w4", key.situ_beta, key.situ_linear_beta, Num())
        assert not torch.equal(other, want), "the isolated check cannot tell MXFP8 from MXFP4 activations"
        # chained, the tail goes through re-quantization (judged by the policy in the CLI replay below)
        assert torch.equal(b[r]["out"], b[0]["out"]) and torch.isfinite(b[r]["out"].float()).all()
        assert set(tb["topk_ids"].flatten().tolist()) <= set(range(w["w13"].shape[0]))


def test_a8w4_capture_replays_through_cli(backend, tmp_path):
    from harness import cli

    caps = tmp_path / "caps"
    assert cli.main(["synth", "--config", "tiny", "--experts", "a8w4", "--layers", "0-2", "--steps", "1",
                     "--out", str(caps), "-q"]) == 0
    rep = tmp_path / "rep.json"
    rc = cli.main(["replay", str(caps), "--backend", "triton", "--isolate", "--quiet", "--json", str(rep)])
    assert rc == 0, rep.read_text()[:2000] if rep.exists() else "no report"
