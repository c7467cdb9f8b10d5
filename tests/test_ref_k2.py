"""K2 (k2_launch over a simulated world) of the reference against the loops of tests/loops.py:
every stage fed the reference's previous tap, end to end, per expert format; the router's
ordering rules on adversarial logits; SiTU; top-k accumulation order; force_ids."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import loops as lp
import ref
from conftest import TINY, clone
from ref.router import select

pytestmark = pytest.mark.cpu

BF16 = torch.bfloat16
FORMATS = ("bf16", "mxfp4", "int4")


def run_world(key, ranks, **extra):
    for r in ranks:
        r["taps"] = {}
    ref.k2_world(key, ranks, **extra)
    return [r.pop("taps") for r in ranks]


def logits_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """fp32 accumulation error bound scale Σ|x||w| [S, E]."""
    return np.abs(x) @ np.abs(w).T


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layer", [1, 2], ids=["plain", "reset"])
def test_stages_isolated(k2_case, fmt, layer):
    key, ranks = k2_case(TINY, layer=layer, fmt=fmt)
    assert key.reset == (layer == 2)
    before = [clone(r) for r in ranks]
    taps = run_world(key, ranks)
    W = len(ranks)
    b, lam = key.situ_beta, key.situ_linear_beta

    # 1. o_proj partials, all-reduce #1
    parts = [lp.bf16(lp.linear(lp.f64(a["core"]), lp.f64(a["w_o"]))) for a in before]
    for r in range(W):
        lp.assert_bf16(f"delta[rank {r}]", taps[r]["delta"], lp.reduce_bf16(parts))
    for r in range(W):
        t, a0, a = taps[r], before[r], ranks[r]
        # 2. prefix update from the delta tap (bit-exact); K2 never writes the bank
        d = lp.f64(t["delta"])
        want_prefix = d if key.reset else lp.bf16(lp.f64(a0["prefix"]) + d)
        lp.assert_bits("prefix", a["prefix"], torch.from_numpy(want_prefix).to(BF16))
        lp.assert_bits("blocks", a["blocks"], a0["blocks"])
        # 3. MLP AttnRes over nblocks rows + the new prefix, post-attention norm
        mixed = lp.attnres(lp.f64(a["blocks"]), lp.f64(a["prefix"]), key.nblocks, lp.f64(a0["ares_nw"]),
                           lp.f64(a0["ares_qk"]), key.eps)
        lp.assert_bf16("x", t["x"], lp.rmsnorm(mixed, lp.f64(a0["in_nw"]), key.out_eps))
        x = lp.f64(t["x"])
        # 4. router from the x tap (logits fp32), selection from the logits tap
        wg = lp.f64(a0["w_gate"])
        assert t["logits"].dtype == torch.float32
        err = np.abs(lp.f64(t["logits"]) - lp.linear(x, wg))
        assert (err <= 2e-6 * logits_bound(x, wg)).all(), f"logits: max err {err.max()}"
        ids, wts = lp.router(lp.f64(t["logits"]), lp.f64(a0["bias"]), key.topk)
        assert t["topk_ids"].dtype == torch.int32
        np.testing.assert_array_equal(t["topk_ids"].numpy(), ids, err_msg="topk_ids")
        lp.assert_close("topk_w", t["topk_w"], wts, rtol=1e-6)
        # 5. latent down
        lp.assert_bf16("lat", t["lat"], lp.linear(x, lp.f64(a0["w_ld"])))
        # 6. shared expert
        lp.assert_bf16("sh", t["sh"], lp.shared_expert(x, lp.f64(a0["w_sgu"]), lp.f64(a0["w_sd"]), b, lam))
        # 7. routed experts from the lat / topk taps
        ex = lp.Experts(a0["w13"], a0["w13s"], a0["w2"], a0["w2s"], fmt)
        y = lp.routed(lp.f64(t["lat"]), t["topk_ids"].numpy(), lp.f64(t["topk_w"]), ex, b, lam)
        # v (bf16 for int4/bf16) and gu are rounded inside the stage: an fp32-vs-exact flip of
        # one of them moves y by up to 2 ulps (seen: int4, 5 of 384 elements at 2 ulps)
        lp.assert_bf16("y", t["y"], y, max_ulp=2)
    # 8. latent all-reduce + norm from every rank's y tap
    ln = lp.rmsnorm(lp.reduce_bf16([lp.f64(t["y"]) for t in taps]), lp.f64(before[0]["ln_w"]), key.ln_eps)
    fins = []
    for r in range(W):
        lp.assert_bf16(f"ln[rank {r}]", taps[r]["ln"], ln)
        # 9. up projection on this rank's columns only
        fin = lp.up_fin(lp.f64(taps[r]["sh"]), lp.f64(taps[r]["ln"]), lp.f64(before[r]["w_up"]), r)
        lp.assert_bf16(f"fin[rank {r}]", taps[r]["fin"], fin)
        n = before[r]["w_up"].shape[0]
        other = torch.ones(TINY.hidden, dtype=torch.bool)
        other[r * n:(r + 1) * n] = False
        lp.assert_bits(f"fin outside rank {r}'s columns", taps[r]["fin"][:, other], taps[r]["sh"][:, other])
        fins.append(lp.f64(taps[r]["fin"]))
    # 10. final reduce, identical on every rank
    for r in range(W):
        lp.assert_bf16(f"out[rank {r}]", ranks[r]["out"], lp.reduce_bf16(fins))
        lp.assert_bits(f"out rank {r} vs rank 0", ranks[r]["out"], ranks[0]["out"])
        for name in ("delta", "x", "logits", "topk_ids", "topk_w", "lat", "ln"):  # replicated values
            lp.assert_bits(f"{name} rank {r} vs rank 0", taps[r][name], taps[0][name])
        lp.assert_bits(f"prefix rank {r} vs rank 0", ranks[r]["prefix"], ranks[0]["prefix"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_end_to_end(k2_case, fmt):
    key, ranks = k2_case(TINY, layer=3, fmt=fmt, S=8)
    before = [clone(r) for r in ranks]
    taps = run_world(key, ranks)
    want = lp.k2_world(key, before)
    for r in range(len(ranks)):
        np.testing.assert_array_equal(taps[r]["topk_ids"].numpy(), want[r]["topk_ids"],
                                      err_msg=f"rank {r} topk_ids (chained)")
        for name in ("delta", "x", "lat", "sh", "y", "ln", "fin"):
            lp.assert_bf16(f"{name}[rank {r}]", taps[r][name], want[r][name], max_ulp=2, max_frac=0.03)
        lp.assert_bits("prefix", ranks[r]["prefix"], torch.from_numpy(want[r]["prefix"]).to(BF16))
        lp.assert_bf16("out", ranks[r]["out"], want[r]["out"], max_ulp=2, max_frac=0.03)
        lp.assert_close("topk_w", taps[r]["topk_w"], want[r]["topk_w"], rtol=1e-4)
        assert not torch.isnan(ranks[r]["out"]).any(), "out: poisoned elements left unwritten"


# ---------------------------------------------------------------- routed-expert numerics

def test_mxfp4_v_not_rounded(k2_case):
    """mxfp4: v goes to the MXFP4 quantizer in fp32. A loop that rounds v to bf16 first (the
    int4/bf16 rule) disagrees with the reference where that rounding crosses an E2M1 midpoint."""
    key, ranks = k2_case(TINY, layer=1, fmt="mxfp4", S=16)
    before = [clone(r) for r in ranks]
    taps = run_world(key, ranks)
    a0, t = before[0], taps[0]
    ex = lp.Experts(a0["w13"], a0["w13s"], a0["w2"], a0["w2s"], "mxfp4")
    args = (lp.f64(t["lat"]), t["topk_ids"].numpy(), lp.f64(t["topk_w"]))
    right = lp.routed(*args, ex, key.situ_beta, key.situ_linear_beta)
    lp.assert_bf16("y", t["y"], right)

    wrong = _routed_round_v(*args, ex, key.situ_beta, key.situ_linear_beta)
    d = np.abs(lp.bf16_ord(lp.f64(t["y"])) - lp.bf16_ord(lp.bf16(wrong)))
    assert d.max() > 1, "test does not discriminate: no v near an E2M1 midpoint at this seed"


def _routed_round_v(lat, ids, wts, ex, beta, lam):
    """lp.routed with v rounded to bf16 before the MXFP4 quantizer (a deliberately wrong variant)."""
    S, LAT = lat.shape
    y = np.zeros((S, LAT))
    for t in range(S):
        a = lp.mx_fake_quant_vec(lat[t])
        for k in range(ids.shape[1]):
            w13, w2 = ex[int(ids[t, k])]
            RI = w13.shape[0] // 2
            v = lp.bf16(np.array([lp.situ(lp.dot(a, w13[i]), lp.dot(a, w13[RI + i]), beta, lam) for i in range(RI)]))
            v = lp.mx_fake_quant_vec(v)
            for d in range(LAT):
                y[t, d] = float(lp.bf16(y[t, d] + float(lp.bf16(lp.dot(v, w2[d]) * wts[t, k]))))
    return y


def test_topk_accumulation_order(k2_case):
    """y = bf16(y + bf16(acc·w)) in pick order from 0: with 8 experts picked the reference
    matches the loop, and a reversed-order loop matches it measurably worse."""
    key, ranks = k2_case(TINY, layer=1, fmt="bf16", S=8, topk=8)
    before = [clone(r) for r in ranks]
    taps = run_world(key, ranks)
    a0, t = before[0], taps[0]
    ex = lp.Experts(a0["w13"], a0["w13s"], a0["w2"], a0["w2s"], "bf16")
    lat, ids, wts = lp.f64(t["lat"]), t["topk_ids"].numpy(), lp.f64(t["topk_w"])
    right = lp.routed(lat, ids, wts, ex, key.situ_beta, key.situ_linear_beta)
    info = lp.assert_bf16("y", t["y"], right)
    rev = lp.routed(lat, ids[:, ::-1], wts[:, ::-1], ex, key.situ_beta, key.situ_linear_beta)
    d_rev = np.abs(lp.bf16_ord(lp.f64(t["y"])) - lp.bf16_ord(rev))
    assert (d_rev > 0).mean() > info["frac"] + 0.02, "reversed accumulation order is not distinguishable"


def test_force_ids(k2_case):
    """force_ids replaces the selection; weights are σ of the forced ids normalized in that order."""
    key, ranks = k2_case(TINY, layer=1, fmt="int4")
    S, K, E = key.tokens, key.topk, TINY.experts
    g = torch.Generator().manual_seed(5)
    forced = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]).to(torch.int32)
    before = [clone(r) for r in ranks]
    for r in ranks:
        r["force_ids"] = forced
    taps = run_world(key, ranks)
    for r, t in enumerate(taps):
        lp.assert_bits("topk_ids", t["topk_ids"], forced)
        _, wts = lp.router(lp.f64(t["logits"]), lp.f64(before[r]["bias"]), K, force_ids=forced.numpy())
        lp.assert_close("topk_w", t["topk_w"], wts, rtol=1e-6)
        a0 = before[r]
        ex = lp.Experts(a0["w13"], a0["w13s"], a0["w2"], a0["w2s"], "int4")
        y = lp.routed(lp.f64(t["lat"]), forced.numpy(), lp.f64(t["topk_w"]), ex, key.situ_beta,
                      key.situ_linear_beta)
        lp.assert_bf16("y", t["y"], y)


def test_situ_values():
    """SiTU against hand values: β·tanh(g/β)·σ(g)·λ·tanh(u/λ)."""
    from ref.shared_expert import situ

    g = torch.tensor([0.0, 1.0, -2.0, 8.0, 30.0, -30.0], dtype=torch.float64)
    u = torch.tensor([1.0, -3.0, 0.5, 100.0, 2.0, 2.0], dtype=torch.float64)
    got = situ(g, u, 4.0, 25.0)
    want = [lp.situ(float(a), float(c), 4.0, 25.0) for a, c in zip(g, u)]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-14, atol=1e-300)
    assert got[0] == 0.0
    assert abs(float(got[3]) - 4 * np.tanh(2) * (1 / (1 + np.exp(-8))) * 25 * np.tanh(4)) < 1e-12
    # saturation: |SiTU| < β·λ
    assert float(situ(torch.tensor([1e4]), torch.tensor([1e4]), 4.0, 25.0)) <= 100.0


# ---------------------------------------------------------------- router rules

def _router_case(k2_case, seed_bias, wg_rows=None):
    """tiny world-1 K2 inputs whose logits are exact: w_gate rows zero except given ones; as many
    experts as biases given, top-2."""
    key, ranks = k2_case(TINY.with_world(1), layer=1, fmt="bf16", S=8, topk=2)
    a = ranks[0]
    n = len(seed_bias)
    for name in ("w_gate", "w13", "w2"):
        a[name] = a[name][:n].contiguous()
    a["w_gate"] = torch.zeros_like(a["w_gate"])
    if wg_rows:
        for e, row in wg_rows.items():
            a["w_gate"][e] = row
    a["bias"] = torch.tensor(seed_bias, dtype=torch.float32)
    return key, ranks


def test_router_all_tied_picks_lowest_ids(k2_case):
    key, ranks = _router_case(k2_case, [0.0] * 8)
    t = run_world(key, ranks)[0]
    assert bool((t["logits"] == 0).all())
    assert t["topk_ids"].tolist() == [[0, 1]] * key.tokens
    assert bool((t["topk_w"] == 0.5).all())


def test_router_ties_at_boundary(k2_case):
    """Keys 0.5+bias with three experts tied for first: the two lowest ids, in id order."""
    key, ranks = _router_case(k2_case, [0.1, 0.3, 0.2, 0.0, 0.3, 0.3, -0.1, 0.25])
    t = run_world(key, ranks)[0]
    assert t["topk_ids"].tolist() == [[1, 4]] * key.tokens


def test_router_key_descending(k2_case):
    key, ranks = _router_case(k2_case, [0.01 * e for e in range(8)])
    t = run_world(key, ranks)[0]
    assert t["topk_ids"].tolist() == [[7, 6]] * key.tokens
    key, ranks = _router_case(k2_case, [0.0, 0.0, 0.0, 0.05, 0.0, 0.04, 0.05, 0.0])
    t = run_world(key, ranks)[0]
    assert t["topk_ids"].tolist() == [[3, 6]] * key.tokens  # tie at the top: lower id first


def test_router_selects_by_key_weights_by_sigma(k2_case):
    """logits: e2 = 4·x_d, e5 = x_d, e6 = -x_d, others 0 (exact). Bias -0.9 / 0.6 / 0.7 makes
    {5, 6} the picks whatever x_d (e2 may have the largest σ), ordered by key, weighted by σ:
    w = (σ(x_d), σ(-x_d)) in pick order, since they sum to 1."""
    H, d = TINY.hidden, 5
    rows = {}
    for e, c in ((2, 4.0), (5, 1.0), (6, -1.0)):
        r = torch.zeros(H, dtype=BF16)
        r[d] = c
        rows[e] = r
    key, ranks = _router_case(k2_case, [0.0, 0.0, -0.9, 0.0, 0.0, 0.6, 0.7, 0.0], rows)
    t = run_world(key, ranks)[0]
    xd = lp.f64(t["x"])[:, d]
    lg = lp.f64(t["logits"])
    np.testing.assert_array_equal(lg[:, 2], 4.0 * xd)
    np.testing.assert_array_equal(lg[:, 5], xd)
    np.testing.assert_array_equal(lg[:, 6], -xd)
    assert (np.sign(xd) != 0).all() and len(set(np.sign(xd))) == 2, "want tokens with x_d of both signs"
    for s_ in range(key.tokens):
        sig = 1 / (1 + np.exp(-xd[s_]))
        want = [5, 6] if sig + 0.6 > 1.7 - sig else [6, 5]
        assert t["topk_ids"][s_].tolist() == want, (s_, xd[s_])
        wsig = [sig, 1 - sig] if want == [5, 6] else [1 - sig, sig]
        np.testing.assert_allclose(t["topk_w"][s_].numpy(), wsig, rtol=1e-6)


def test_router_select_nan_rules():
    """The router stage on NaN logits: a NaN key ranks below every number (NaNs among
    themselves by id), a NaN σ weighs 0; ±inf logits are ordinary σ = 1 / 0."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan, 0.0, nan, 1.0, -inf, inf],
                           [nan, nan, nan, nan, -2.0, nan],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.3, -0.6], dtype=torch.float32)
    ids, w = select(logits, bias, 4)
    assert ids.dtype == torch.int32
    want_ids, want_w = lp.router(lp.f64(logits), lp.f64(bias), 4)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    lp.assert_close("weights", w, want_w, rtol=1e-6)
    # hand values: row 0 keys: e1 .5, e3 σ(1), e4 0.3, e5 0.4, NaNs e0 e2 last
    assert ids.tolist() == [[3, 1, 5, 4], [4, 0, 1, 2], [4, 0, 1, 2]]
    assert float(w[1, 0]) == 1.0 and bool((w[1, 1:] == 0).all())  # NaN σ count as 0


def test_router_select_random_against_loop(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, 16, generator=g)
    logits[torch.rand(64, 16, generator=g) < 0.1] = float("nan")
    logits[:8] = torch.round(logits[:8] * 2) / 2  # many exact ties
    bias = (torch.randint(0, 3, (16,), generator=g) * 0.125).float()
    ids, w = select(logits, bias, 5)
    want_ids, want_w = lp.router(lp.f64(logits), lp.f64(bias), 5)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    lp.assert_close("weights", w, want_w, rtol=1e-6)



@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_dims_come_from_shapes(seed, fmt):
    """A K2 unlike any preset (hidden 96, 6 experts, top-3, LAT 32, world 2): matches the loops."""
    from conftest import make_k2

    cfg = dataclasses.replace(TINY, name="odd", hidden=96, nh=3, hd=8, experts=6, topk=3, lat=32, layers=5,
                              block_size=3, mla_layers=())
    key, ranks = make_k2(cfg, seed, layer=3, fmt=fmt, S=5)
    assert key.reset and key.nblocks == 2 and ranks[0]["w_up"].shape == (48, 32)
    before = [clone(r) for r in ranks]
    taps = run_world(key, ranks)
    want = lp.k2_world(key, before)
    for r in range(2):
        np.testing.assert_array_equal(taps[r]["topk_ids"].numpy(), want[r]["topk_ids"])
        for name in ("delta", "x", "lat", "sh", "y", "ln", "fin"):
            lp.assert_bf16(f"{name}[rank {r}]", taps[r][name], want[r][name], max_ulp=2, max_frac=0.03)
        lp.assert_bf16("out", ranks[r]["out"], want[r]["out"], max_ulp=2, max_frac=0.03)
