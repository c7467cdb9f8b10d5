"""Triton backend, interpreted (tiny config): the dtypes vLLM passes (DESIGN §6, issue J).

K1 with an fp32 `conv_w` (vLLM's conv1d.weight, values that are not bf16) and fp32
`a_log` / `dt_bias`; K2 with the router `bias` in fp32 or bf16. The conv is a stage the
reference computes bit for bit (four fp32 products summed in tap order), so the backend's
conv output, fed the backend's own in_proj rows, must equal the reference's bit for bit,
and sit within one bf16 ulp of the float64 loops of tests/loops.py; the carried window is
bit-exact. The gates go through exp/sigmoid (libm-dependent in the last fp32 bit): judged
against the reference and the loops at fp32 resolution.
"""
from __future__ import annotations

import pytest
import torch

from triton_tier import backend, triton, tune  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import loops as lp  # noqa: E402
import ref  # noqa: E402
from conftest import TINY, clone, make_k2  # noqa: E402
from ref._num import Num  # noqa: E402
from ref.conv import short_conv  # noqa: E402
from ref.gate import gates  # noqa: E402
from ref.router import select  # noqa: E402

pytestmark = pytest.mark.interpret
BF16 = torch.bfloat16


def _fp32_conv_w(kw: dict, g: torch.Generator) -> torch.Tensor:
    """An fp32 conv weight whose values need all 24 bits (not bf16 values cast up)."""
    w = kw["conv_w"].float()
    w = w * (1.0 + 2.0 ** -9 * torch.rand(w.shape, generator=g)) + 1e-4 * torch.randn(w.shape, generator=g)
    assert (w.to(BF16).float() != w).float().mean() > 0.99
    return w.contiguous()


def _k1(k1_case, seed, **kw):
    key, a = k1_case(**kw)
    g = torch.Generator().manual_seed(seed ^ 0xC0)
    a["conv_w"] = _fp32_conv_w(a, g)
    assert a["a_log"].dtype == torch.float32 and a["dt_bias"].dtype == torch.float32
    return key, a


def _conv_isolated(key, before, proj_tap, conv_w):
    """The reference conv fed the backend's in_proj rows: (conv_out, conv_state after)."""
    P = TINY.p
    cs = before["conv_state"].clone()
    out = short_conv(proj_tap[:, :3 * P], conv_w, cs, before["st_idx"], before["num_acc"], key.qlen, Num())
    return out, cs


@pytest.mark.parametrize("layer,R,L,pad", [(2, 4, 3, 2), (3, 3, 2, 0), (1, 5, 1, 3)])
def test_k1_fp32_conv_w_and_gates(backend, tune, k1_case, seed, layer, R, L, pad):
    tune.update(k1_nv=2)
    key, kw = _k1(k1_case, seed, layer=layer, R=R, L=L, with_delta=True, pad_every=pad)
    before = clone(kw)
    a, b = clone(kw), clone(kw)
    b["core_out"].fill_(float("nan"))
    ta, tb = {}, {}
    ref.kda_pre(key, **a, taps=ta)
    backend.kda_pre(key, **b, taps=tb)
    # conv: bit-exact against the reference stage on the same input, and against the loops
    want, cs = _conv_isolated(key, before, tb["proj"], before["conv_w"])
    lp.assert_bits("conv_out (isolated)", tb["conv_out"], want)
    lp.assert_bits("conv_state", b["conv_state"], cs)
    st, na = before["st_idx"].numpy(), before["num_acc"].numpy()
    loop_out, loop_cs = lp.short_conv(lp.f64(tb["proj"]), lp.f64(before["conv_w"]), lp.f64(before["conv_state"]),
                                      st, na, L)
    lp.assert_bf16("conv_out vs loops", tb["conv_out"], loop_out)
    lp.assert_bits("conv_state vs loops", b["conv_state"], torch.from_numpy(loop_cs).to(BF16))
    # a kernel reading the fp32 weight as bf16 would be caught by the bit-exact check above
    rounded, _ = _conv_isolated(key, before, tb["proj"], before["conv_w"].to(BF16))
    assert not torch.equal(rounded, want), "test is blind to conv_w read as bf16"
    # gates from the backend's proj: fp32 a_log / dt_bias read exactly (fp32-level agreement)
    P, RK, NH = TINY.p, TINY.rank, TINY.nh
    proj = tb["proj"]
    gate, beta = gates(proj[:, 4 * P:4 * P + RK], proj[:, 4 * P + RK:4 * P + RK + NH], before["w_fb"],
                       before["a_log"], before["dt_bias"], key.lower_bound, Num())
    # measured (interpreter, 3 cases): gate rel 2.0e-6, beta 1.5e-7 — ulp-level exp/sigmoid
    # differences amplified by |A·(g1+dt_bias)| up to ~16; limits 4x that
    torch.testing.assert_close(tb["gate"], gate, rtol=8e-6, atol=0)
    torch.testing.assert_close(tb["beta"], beta, rtol=1e-6, atol=0)
    lg, lb = lp.gates(lp.f64(proj), lp.f64(before["w_fb"]), lp.f64(before["a_log"]), lp.f64(before["dt_bias"]),
                      key.lower_bound)
    lp.assert_close("gate vs loops", tb["gate"], lg, rtol=8e-6)
    lp.assert_close("beta vs loops", tb["beta"], lb, rtol=1e-6)
    # the rest of the layer still agrees with the reference chained
    assert torch.equal(b["prefix"], a["prefix"]) and torch.equal(b["blocks"], a["blocks"])
    cos = torch.nn.functional.cosine_similarity(b["core_out"].float().flatten(), a["core_out"].float().flatten(), 0)
    assert torch.isfinite(b["core_out"].float()).all() and cos >= 0.9999


def test_k1_bf16_conv_w_still_bit_exact(backend, tune, k1_case):
    key, kw = k1_case(layer=1, R=3, L=3, with_delta=True, pad_every=2)
    kw["conv_w"] = kw["conv_w"].to(BF16)  # synth draws vLLM's fp32 conv weight; bf16 stays accepted
    before = clone(kw)
    b = clone(kw)
    tb = {}
    backend.kda_pre(key, **b, taps=tb)
    want, cs = _conv_isolated(key, before, tb["proj"], before["conv_w"])
    lp.assert_bits("conv_out (isolated, bf16 conv_w)", tb["conv_out"], want)
    lp.assert_bits("conv_state", b["conv_state"], cs)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_k2_router_bias_dtype_read_exactly(backend, tune, seed, bias_dtype):
    """Router bias in fp32 (values that are not bf16) or bf16: the backend's picks and weights
    are the reference selection on the backend's own logits with that exact bias."""
    key, ranks = make_k2(seed=seed, fmt="bf16", layer=1, S=5)
    g = torch.Generator().manual_seed(seed ^ 0xB1)
    E = ranks[0]["w_gate"].shape[0]
    bias = (0.05 * torch.randn(E, generator=g)).to(bias_dtype)
    if bias_dtype == torch.float32:
        assert (bias.to(BF16).float() != bias).all()
    for r in ranks:
        r["bias"] = bias.clone()
    b = [dict(clone(r), taps={}) for r in ranks]
    ref.k2_world(key, b, launch=backend.k2_launch)
    for r in range(len(ranks)):
        tb = b[r]["taps"]
        ids, w = select(tb["logits"], bias, key.topk)
        assert torch.equal(tb["topk_ids"], ids)
        torch.testing.assert_close(tb["topk_w"], w, rtol=1e-6, atol=0)  # σ formula: measured 1.4e-7
        # the bias really moved the selection (else the test could not see it read wrongly)
        ids0, _ = select(tb["logits"], torch.zeros_like(bias), key.topk)
        assert not torch.equal(ids0, ids) or key.topk == E
