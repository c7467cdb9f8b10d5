"""Triton backend, K2, in the CPU interpreter (tiny config, world 2, simulated collective)
against the reference, for the three expert formats; the router's tie/NaN rules against
the reference selection on the backend's own logits; the MXFP4/int4 device helpers
against ref.quant. TRITON_INTERPRET=1 is set here before the kernels are first imported.
"""
from __future__ import annotations


import pytest
import torch

from triton_tier import backend, triton, tune  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import triton.language as tl  # noqa: E402

import ref  # noqa: E402
from fast.triton import _jit as fj  # noqa: E402
from conftest import clone, make_k2  # noqa: E402
from ref import abi, quant  # noqa: E402
from ref.router import select  # noqa: E402

pytestmark = pytest.mark.interpret


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def _gt1ulp(a, b):
    a, b = a.float(), b.float()
    e = torch.floor(torch.log2(b.abs().clamp_min(2.0 ** -100)))
    return float(((a - b).abs() > torch.exp2(e - 7) * 1.001).float().mean())


def _world(backend, key, ranks):
    """Both sides over every rank; returns (ref ranks, backend ranks) with taps."""
    a = [dict(clone(r), taps={}) for r in ranks]
    b = [dict(clone(r), taps={}) for r in ranks]
    for x in b:
        x["out"].fill_(float("nan"))
    ref.k2_world(key, a)
    ref.k2_world(key, b, launch=backend.k2_launch)
    return a, b


@pytest.mark.parametrize("fmt,layer,tune_set", [
    ("bf16", 2, {}),                                   # block-write layer: prefix reset to delta
    ("mxfp4", 1, {}),
    ("int4", 2, {}),
    ("mxfp4", 3, dict(k2_swap=True, x1_swap=True, x2_swap=True, mid_swap=True, up_swap=True, mid_split=2, o_split=2, up_split=2,
                      k2_bk=32, mid_bk=32, up_bk=32, mid_bn=16, mid_bnl=32, mid_bns=16, x2_bl=32, mid_hc=48)),
    ("a8w4", 1, dict(x1_unr=1, x1_split=2, mid_bn=4, mid_hc=32)),  # gemm1 K split; 4 router blocks of 4
    ("int4", 3, dict(x1_unr=1, x1_split=2, mid_bn=8)),
])
def test_k2_world_matches_reference(backend, tune, k2_case, fmt, layer, tune_set):
    tune.update(tune_set)
    key, ranks = k2_case(fmt=fmt, layer=layer, S=6)
    assert key.reset == (layer % 2 == 0)
    a, b = _world(backend, key, ranks)
    for r in range(len(ranks)):
        assert torch.equal(b[r]["out"], b[0]["out"]), "out differs between ranks"
        assert torch.isfinite(b[r]["out"].float()).all()
        assert _cos(b[r]["out"], a[r]["out"]) >= 0.9999 and _gt1ulp(b[r]["out"], a[r]["out"]) <= 0.02
        assert _cos(b[r]["prefix"], a[r]["prefix"]) >= 0.9999 and _gt1ulp(b[r]["prefix"], a[r]["prefix"]) <= 0.01
        tb, ta = b[r]["taps"], a[r]["taps"]
        assert set(tb) == set(abi.K2_TAPS)
        for n in abi.K2_TAPS:
            assert tb[n].shape == ta[n].shape and tb[n].dtype == ta[n].dtype, n
        for t in range(key.tokens):
            assert set(tb["topk_ids"][t].tolist()) == set(ta["topk_ids"][t].tolist())
        for n in ("delta", "x", "lat", "sh", "y", "ln", "fin"):
            assert _cos(tb[n], ta[n]) >= 0.9999, n
            assert _gt1ulp(tb[n], ta[n]) <= 0.02, n


def test_router_ties_and_nan(backend, tune, k2_case):
    """Equal keys go to the lower expert id, NaN keys rank last, NaN σ weighs 0: the
    backend's picks equal the reference selection rule applied to the backend's logits."""
    key, ranks = k2_case(fmt="bf16", layer=1, S=3)
    E = ranks[0]["w_gate"].shape[0]
    for r in ranks:
        r["w_gate"][5] = r["w_gate"][2]          # identical rows: exactly tied keys
        r["bias"][5] = r["bias"][2]
        r["w_gate"][1] = r["w_gate"][6]
        r["bias"][1] = r["bias"][6] + 1.0       # expert 1 ranks first everywhere
        r["w_gate"][7, 0] = float("nan")         # expert 7: NaN logits for every token
    b = [dict(clone(r), taps={}) for r in ranks]
    ref.k2_world(key, b, launch=backend.k2_launch)
    for r in range(len(ranks)):
        tb = b[r]["taps"]
        ids, w = select(tb["logits"], ranks[r]["bias"], key.topk)
        assert torch.equal(tb["topk_ids"], ids)
        assert torch.allclose(tb["topk_w"], w, rtol=1e-6, atol=0)
        assert (tb["topk_ids"][:, 0] == 1).all()
        assert not (tb["topk_ids"] == 7).any() or key.topk == E
    assert key.topk == 4 and E == 16


def test_k2_scratch_reused_and_counters_reset(backend, tune, k2_case):
    from fast.triton import _host

    tune.update(mid_split=2, k2_bk=32)
    key, ranks = k2_case(fmt="mxfp4", layer=1, S=4)
    _world(backend, key, ranks)
    n = len(_host._SCRATCH)
    _world(backend, key, ranks)
    assert len(_host._SCRATCH) == n
    for k, v in _host._SCRATCH.items():
        if k[1] == key:
            for c in ("ctr", "ctr_lb", "ctr_n", "ctr_u", "ctr_m"):
                assert int(v[c].abs().sum()) == 0, c


# --------------------------------------------------------------- device helpers

@triton.jit
def _helpers_kernel(v_ptr, q_ptr, c_ptr, b_ptr, lo_ptr, hi_ptr, ilo_ptr, ihi_ptr, SP: tl.constexpr, BN: tl.constexpr):
    rs = tl.arange(0, SP)
    rn = tl.arange(0, BN)
    v = tl.load(v_ptr + rs[:, None] * BN + rn[None, :])
    q, code = fj.mx_quant_rows(v, SP, BN)
    tl.store(q_ptr + rs[:, None] * BN + rn[None, :], q)
    rg = tl.arange(0, BN // 32)
    tl.store(c_ptr + rs[:, None] * (BN // 32) + rg[None, :], code)
    b = tl.load(b_ptr + rs[:, None] * BN + rn[None, :])
    lo, hi = fj.e2m1_f16x2(b)
    tl.store(lo_ptr + rs[:, None] * BN + rn[None, :], lo.to(tl.float32))
    tl.store(hi_ptr + rs[:, None] * BN + rn[None, :], hi.to(tl.float32))
    ilo, ihi = fj.int4_bf16x2(b)
    tl.store(ilo_ptr + rs[:, None] * BN + rn[None, :], ilo.to(tl.float32))
    tl.store(ihi_ptr + rs[:, None] * BN + rn[None, :], ihi.to(tl.float32))


def test_quant_helpers_match_reference(backend, rng):
    """Activation MXFP4 quantization (values, codes, ties, zero blocks) and the in-register
    decoders of packed E2M1 / int4 bytes, against ref.quant."""
    SP, BN = 4, 64
    v = torch.randn(SP, BN, generator=rng) * torch.exp2(torch.randint(-6, 6, (SP, BN // 32), generator=rng).float()
                                                        ).repeat_interleave(32, 1)
    v[0, :32] = 0.0                                           # amax 0 -> code 0
    v[1, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # ties with scale 1 (amax 6)
    v[1, 8:32] = 0.1
    b = torch.randint(0, 256, (SP, BN), generator=rng, dtype=torch.uint8)
    q, c = torch.empty(SP, BN), torch.empty(SP, BN // 32, dtype=torch.int32)
    lo, hi, ilo, ihi = (torch.empty(SP, BN) for _ in range(4))
    _helpers_kernel[(1,)](v, q, c, b, lo, hi, ilo, ihi, SP=SP, BN=BN)
    codes, scale = quant.mx_quant(v)
    assert torch.equal(c, scale.to(torch.int32))
    assert torch.equal(q, quant.e2m1_decode(codes))
    nib = quant.unpack_nibbles(b)  # [SP, 2·BN]: even = low nibble
    assert torch.equal(lo * 2.0 ** 14, quant.e2m1_decode(nib[:, 0::2]))
    assert torch.equal(hi * 2.0 ** 14, quant.e2m1_decode(nib[:, 1::2]))
    assert torch.equal(ilo, nib[:, 0::2].float() - 8)
    assert torch.equal(ihi, nib[:, 1::2].float() - 8)
