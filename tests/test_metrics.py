"""harness.metrics: every metric against values computed by hand on small tensors."""
from __future__ import annotations

import math

import pytest
import torch

from harness.metrics import (MAG_BINS, ULP_BINS, ShapeMismatch, align_by_ids, bf16_ulp, compare,
                             compare_routing, scalars)

pytestmark = pytest.mark.cpu
BF16 = torch.bfloat16


def test_hand_computed_vector():
    # a = candidate, b = reference; all values exact in bf16
    a = torch.tensor([1.0, 2.0, 3.0, 4.5], dtype=BF16)
    b = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=BF16)
    m = compare(a, b, dims=("channel",), atol=0.0, rtol=0.1)
    sum_b2, sum_a2, sum_ab, sum_d2 = 30.0, 34.25, 32.0, 0.25
    assert m["n"] == 4 and m["shape"] == [4]
    assert m["max_abs"] == 0.5
    assert m["mean_abs"] == pytest.approx(0.5 / 4)
    assert m["rel_l2"] == pytest.approx(0.5 / math.sqrt(sum_b2))
    assert m["cosine"] == pytest.approx(sum_ab / math.sqrt(sum_a2 * sum_b2))
    assert m["sqnr_db"] == pytest.approx(10 * math.log10(sum_b2 / sum_d2))
    assert m["calc_diff"] == pytest.approx(1 - 2 * sum_ab / (sum_a2 + sum_b2))
    assert m["scale_err"] == pytest.approx(sum_ab / sum_b2 - 1)
    # bf16 spacing at 4.0 is 2^(2-7) = 1/32: an error of 0.5 is 16 ulps
    assert m["max_ulp"] == pytest.approx(16.0)
    # |0.5| > 0 + 0.1*4 -> one mismatch of four
    assert m["mismatch_frac"] == pytest.approx(0.25)
    assert m["exact_frac"] == pytest.approx(0.75)
    assert m["n_differ"] == 1 and m["exact"] is False
    assert m["worst"] == {"channel": 3} and m["worst_ulp"] == {"channel": 3}
    assert (m["worst_a"], m["worst_b"]) == (4.5, 4.0)
    assert m["ref_absmax"] == 4.0 and m["ref_rms"] == pytest.approx(math.sqrt(7.5))
    assert (m["nan_a"], m["inf_a"], m["nan_b"], m["inf_b"]) == (0, 0, 0, 0)


def test_mismatch_atol_and_atol_rms():
    a = torch.tensor([0.0, 1.0, 2.0, 3.0])
    b = torch.tensor([0.1, 1.0, 2.0, 3.3])
    assert compare(a, b, atol=0.05, rtol=0.0)["mismatch_frac"] == pytest.approx(0.5)
    assert compare(a, b, atol=0.15, rtol=0.0)["mismatch_frac"] == pytest.approx(0.25)
    # rms(b) = sqrt((0.01 + 1 + 4 + 10.89) / 4) = 1.99374...; 0.2 rms = 0.3987 covers both errors
    rms = math.sqrt((0.01 + 1 + 4 + 10.89) / 4)
    m = compare(a, b, atol=0.0, rtol=0.0, atol_rms=0.31 / rms)
    assert m["mismatch_frac"] == pytest.approx(0.0)
    assert m["atol_rms"] == pytest.approx(0.31 / rms)


def test_named_worst_location_3d(rng):
    b = torch.randn(2, 3, 4, generator=rng).to(BF16)
    a = b.clone()
    a[1, 2, 3] = a[1, 2, 3].float() + 2.0  # the largest error by construction
    a[0, 1, 0] = a[0, 1, 0].float() + 0.5
    m = compare(a, b, dims=("token", "head", "channel"))
    assert m["worst"] == {"token": 1, "head": 2, "channel": 3}
    assert m["worst_a"] == float(a[1, 2, 3]) and m["worst_b"] == float(b[1, 2, 3])
    # a tap name looks its dims up in ref.abi.TAP_DIMS ("gate": token, head, channel)
    assert compare(a, b, dims="gate")["worst"] == {"token": 1, "head": 2, "channel": 3}
    # unknown names or a rank mismatch fall back to d0, d1, ...
    assert compare(a, b, dims=("token",))["worst"] == {"d0": 1, "d1": 2, "d2": 3}


def test_exact_is_bitwise():
    pz, nz = torch.tensor([0.0], dtype=BF16), torch.tensor([-0.0], dtype=BF16)
    m = compare(nz, pz)
    assert m["exact"] is False and m["n_differ"] == 1  # the sign of zero counts
    assert m["exact_frac"] == 1.0 and m["max_abs"] == 0.0  # equal in value
    nan1 = torch.tensor([0x7FC0], dtype=torch.int16).view(BF16)
    nan2 = torch.tensor([0x7FC1], dtype=torch.int16).view(BF16)
    m = compare(nan2, nan1)
    assert m["exact"] is False and m["n_differ"] == 1  # NaN payloads count
    assert m["nan_a"] == 1 and m["nan_b"] == 1 and m["mismatch_frac"] == 0.0
    assert compare(nan1, nan1.clone())["exact"] is True
    # equal values in another dtype are not exact (and say why)
    m = compare(torch.tensor([1.5, 2.0]), torch.tensor([1.5, 2.0], dtype=BF16))
    assert m["exact"] is False and m["dtype_match"] is False and m["n_differ"] == 0


def test_nonfinite_counts_and_worst():
    a = torch.tensor([float("nan"), 1.0, float("inf"), 2.0])
    b = torch.tensor([1.0, 1.0, float("inf"), float("-inf")])
    m = compare(a, b)
    assert (m["nan_a"], m["inf_a"], m["nan_b"], m["inf_b"]) == (1, 1, 0, 2)
    assert m["max_abs"] == math.inf and m["max_ulp"] == math.inf
    assert m["worst"] == {"d0": 0}  # the first non-finite disagreement
    assert m["ulp_hist"][ULP_BINS.index("nonfinite")] == 2  # elements 0 and 3; 2 is the same inf
    assert m["mismatch_frac"] == pytest.approx(0.5)
    assert m["exact_frac"] == pytest.approx(0.5)


def test_integer_tensors():
    a = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    b = torch.tensor([[1, 2], [3, 7]], dtype=torch.int32)
    m = compare(a, b, dims="topk_ids")
    assert m["exact"] is False and m["n_differ"] == 1
    assert m["max_abs"] == 3.0 and m["max_ulp"] == 3.0  # integers: the unit is 1
    assert m["worst"] == {"token": 1, "k": 1}
    assert compare(a, a.clone())["exact"] is True


def test_empty():
    m = compare(torch.zeros(0, 4, dtype=BF16), torch.zeros(0, 4, dtype=BF16))
    assert m["n"] == 0 and m["exact"] is True and m["rel_l2"] == 0.0 and m["cosine"] == 1.0
    assert m["worst"] is None and m["mismatch_frac"] == 0.0 and sum(m["ulp_hist"]) == 0


def test_all_zero_reference():
    z = torch.zeros(3, dtype=BF16)
    m = compare(z, z.clone())
    assert (m["rel_l2"], m["cosine"], m["calc_diff"], m["sqnr_db"]) == (0.0, 1.0, 0.0, math.inf)
    assert m["worst"] is None and m["max_ulp"] == 0.0
    a = torch.tensor([0.0, 2.0 ** -10, 0.0], dtype=BF16)
    m = compare(a, z)
    assert m["rel_l2"] == math.inf and m["cosine"] == 0.0 and m["sqnr_db"] == -math.inf
    assert m["calc_diff"] == 1.0  # 1 - 0 / (a.a)
    # an all-zero reference has no scale: its ulp is the subnormal spacing 2^-133
    assert m["max_ulp"] == pytest.approx(2.0 ** -10 / 2.0 ** -133)
    assert m["worst"] == {"d0": 1}


def test_bf16_ulp_hand_values():
    x = torch.tensor([1.0, 1.5, 2.0, -3.0, 0.0, 1e-40, 255.9, 1.00001], dtype=torch.float32)
    # 255.9 rounds to 256 in bf16 (spacing 2); 1.00001 rounds to 1.0; zero/subnormal: 2^-133
    want = [2.0 ** -7, 2.0 ** -7, 2.0 ** -6, 2.0 ** -6, 2.0 ** -133, 2.0 ** -133, 2.0, 2.0 ** -7]
    assert bf16_ulp(x).tolist() == want
    assert bf16_ulp(torch.tensor([0.0, 3.0]), floor=1.0).tolist() == [2.0 ** -7, 2.0 ** -6]


def test_ulp_floor_at_rms():
    # rms(b) = sqrt(48/4) = 3.464; floor = rms/256 = 0.01353 lies in [2^-7, 2^-6): ulp 2^-14
    b = torch.tensor([0.0, 4.0, 4.0, 4.0], dtype=BF16)
    a = torch.tensor([2.0 ** -10, 4.0, 4.0, 4.0], dtype=BF16)
    m = compare(a, b)
    assert m["max_ulp"] == pytest.approx(2.0 ** -10 / 2.0 ** -14)
    assert m["worst_ulp"] == {"d0": 0}


def test_ulp_histogram_bins():
    u = 2.0 ** -7  # bf16 spacing at 1.0
    b = torch.ones(5)
    a = torch.tensor([1.0, 1 + 0.25 * u, 1 + u, 1 + 3 * u, 1 + 100 * u])
    h = dict(zip(ULP_BINS, compare(a, b)["ulp_hist"]))
    assert h["0"] == 1 and h["<=0.5"] == 1 and h["<=1"] == 1 and h["<=4"] == 1 and h["<=256"] == 1
    assert sum(h.values()) == 5


def test_magnitude_bins():
    b = torch.tensor([0.0, 5e-7, 0.5, 50.0], dtype=torch.float64)
    a = b + torch.tensor([1e-9, 2e-9, 3e-3, 4e-2], dtype=torch.float64)
    me = compare(a, b)["mag_err"]
    cnt = dict(zip(MAG_BINS, me["count"]))
    mx = dict(zip(MAG_BINS, me["max_abs"]))
    assert cnt["0"] == 1 and cnt["<=1e-6"] == 1 and cnt["<=1e0"] == 1 and cnt["<=1e2"] == 1
    assert mx["<=1e0"] == pytest.approx(3e-3) and mx["<=1e2"] == pytest.approx(4e-2)


def test_float64_oracle_against_bf16(rng):
    o = torch.randn(4, 8, generator=rng, dtype=torch.float64)
    r = o.to(BF16)
    m = compare(r, o)
    # one bf16 rounding: at most half an ulp of the reference's bf16 value
    assert 0 < m["max_ulp"] <= 0.5
    assert m["rel_l2"] < 2.0 ** -8


def test_shape_mismatch():
    with pytest.raises(ShapeMismatch, match=r"\(2, 3\).*\(3, 2\)"):
        compare(torch.zeros(2, 3), torch.zeros(3, 2))


def test_routing_sets_and_ties():
    ids_b = torch.tensor([[0, 1], [2, 4], [5, 6]], dtype=torch.int32)
    ids_a = torch.tensor([[1, 0], [2, 3], [5, 7]], dtype=torch.int32)
    keys = torch.zeros(3, 8, dtype=torch.float64)
    keys[0, [0, 1]] = torch.tensor([0.9, 0.8], dtype=torch.float64)
    keys[1, [2, 3, 4]] = torch.tensor([0.9, 0.5 + 1e-7, 0.5], dtype=torch.float64)  # near tie
    keys[2, [5, 6, 7]] = torch.tensor([0.9, 0.6, 0.2], dtype=torch.float64)  # far: a wrong pick
    m = compare_routing(ids_a, ids_b, keys, tie_eps=1e-6)
    assert m["sets_equal"] is False
    assert m["set_diff_tokens"] == 2  # token 0 differs only in order
    assert m["tied_tokens"] == [1] and m["untied_list"] == [2] and m["untied_tokens"] == 1
    assert m["boundary_gap"] == pytest.approx(0.4)  # |0.2 - 0.6| at token 2
    m = compare_routing(ids_a[:2], ids_b[:2], keys[:2], tie_eps=1e-8)
    assert m["untied_tokens"] == 1 and m["tied_tokens"] == []


def test_align_by_ids():
    ids_a = torch.tensor([[3, 1], [2, 5]])
    w_a = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    ids_b = torch.tensor([[1, 3], [2, 4]])
    out = align_by_ids(ids_a, w_a, ids_b)
    assert out.tolist() == [[pytest.approx(0.3), pytest.approx(0.7)], [pytest.approx(0.6), pytest.approx(0.4)]]


def test_scalars_drop_histograms(rng):
    b = torch.randn(8, generator=rng)
    s = scalars(compare(b + 1e-3, b))
    assert "ulp_hist" not in s and "worst" not in s and s["rel_l2"] > 0


def test_detail_false_keeps_the_scalars(rng):
    b = torch.randn(4, 16, generator=rng).to(BF16)
    a = (b.float() * (1 + 0.01 * torch.randn(4, 16, generator=rng))).to(BF16)
    full, light = compare(a, b, "x"), compare(a, b, "x", detail=False)
    assert "worst" not in light and "ulp_hist" not in light and "mag_err" not in light
    assert scalars(full) == scalars(light)


# ---------------------------------------------------------------- isolated top-k picks

def _picks_case():
    """8 experts, top-3: keys 0.9, 0.8, 0.8 (experts 1 and 2 twins: same logit and bias),
    0.8 + 1 fp32 ulp (expert 3, through its bias), then small ones."""
    from harness.metrics import compare_picks

    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    lg = torch.tensor([[logit(0.9), logit(0.8), logit(0.8), logit(0.8), -3.0, -3.0, -4.0, -5.0]], dtype=torch.float32)
    bias = torch.zeros(8, dtype=torch.float32)
    bias[3] = 2.0 ** -24  # one fp32 ulp of a key in [0.5, 1)
    key = (torch.sigmoid(lg) + bias)[0]
    ref_ids = torch.sort(key, descending=True, stable=True).indices[:3].to(torch.int32)[None]
    return compare_picks, lg, bias, key, ref_ids


def test_picks_pass_a_swap_within_the_window():
    compare_picks, lg, bias, key, ref_ids = _picks_case()
    assert ref_ids.tolist() == [[0, 3, 1]]  # 3 sits 1 ulp above the twins 1, 2
    same = compare_picks(ref_ids, ref_ids, lg, bias, 3.8e-6)
    assert same["untied_tokens"] == 0 and same["set_diff_tokens"] == 0
    swapped = compare_picks(torch.tensor([[0, 1, 3]]), ref_ids, lg, bias, 3.8e-6)
    gap = float(key[3].double() - key[1].double())
    assert swapped["untied_tokens"] == 0 and swapped["set_diff_tokens"] == 1
    assert swapped["boundary_gap"] == pytest.approx(gap) and 0 < gap < 1e-6
    # the same swap with no window fails
    assert compare_picks(torch.tensor([[0, 1, 3]]), ref_ids, lg, bias, 0.0)["untied_tokens"] == 1


def test_picks_fail_twins_out_of_id_order_and_real_misorders():
    compare_picks, lg, bias, key, ref_ids = _picks_case()
    win = 3.8e-6
    # 2 instead of 1 at the boundary: a twin tie, lowest id first -> fails
    assert compare_picks(torch.tensor([[0, 3, 2]]), ref_ids, lg, bias, win)["untied_tokens"] == 1
    # twins 2 before 1 when both are picked (top-4 case)
    ref4 = torch.tensor([[0, 3, 1, 2]])
    assert compare_picks(torch.tensor([[0, 3, 2, 1]]), ref4, lg, bias, win)["untied_tokens"] == 1
    # 0.9 after 0.8: a key gap of 0.1
    assert compare_picks(torch.tensor([[3, 0, 1]]), ref_ids, lg, bias, win)["untied_tokens"] == 1
    # an expert far below the K-th key, a duplicate, an id out of range
    for bad in ([0, 3, 4], [0, 3, 3], [0, 3, 9]):
        assert compare_picks(torch.tensor([bad]), ref_ids, lg, bias, win)["untied_tokens"] == 1, bad


# ---------------------------------------------------------------- a sum's operand ulps

def test_delta_unit_counts_the_partials_ulps():
    """delta = bf(p0 + p1) with p0 = 1.0, p1 = -0.99609375 (cancels to 2^-8): one ulp of p1
    (2^-8) moves delta by 2^-8 = 128 of its own ulps; in delta's unit (ulp(delta) + ulp(p0)
    + ulp(p1), by hand) that is under one. Two operand ulps are not."""
    from harness.isolate import delta_ulp_unit
    from harness.metrics import compare_lazy, resolve

    p = torch.tensor([[1.0, -0.99609375]], dtype=BF16)  # one rank per column below
    core = [torch.eye(1, dtype=BF16), torch.eye(1, dtype=BF16)]
    ranks = [dict(core=core[0], w_o=p[:, :1].T.contiguous()), dict(core=core[1], w_o=p[:, 1:].T.contiguous())]
    delta = (p.float().sum(dim=1, keepdim=True)).to(BF16)
    assert float(delta) == 2.0 ** -8
    unit = delta_ulp_unit(ranks, delta)
    by_hand = 2.0 ** -8 * 2 ** -7 + 2.0 ** -7 + 2.0 ** -8  # ulp(2^-8) + ulp(1.0) + ulp(0.996)
    assert float(unit) == by_hand
    one_off = delta + 2.0 ** -8  # p1 one ulp higher
    plain = resolve([compare_lazy(one_off, delta)])[0]["max_ulp"]
    ours = resolve([compare_lazy(one_off, delta, ulp_unit=unit)])[0]["max_ulp"]
    assert plain == 128 and ours < 1
    two_off = (delta.float() + 2.0 ** -6).to(BF16)
    assert resolve([compare_lazy(two_off, delta, ulp_unit=unit)])[0]["max_ulp"] > 1
    with pytest.raises(ShapeMismatch):
        compare_lazy(delta, delta, ulp_unit=unit.reshape(-1).repeat(2))


def test_batched_rows_equal_each_alone():
    """compare_many stacks same-shape comparisons (the judge's batching): every row's dict is
    the one compare_lazy gives alone, with NaN / inf / zero-reference rows and a ulp unit in
    the mix; shapes that differ are computed apart."""
    from harness.metrics import Batch, compare_lazy, compare_many, resolve

    g = torch.Generator().manual_seed(7)
    bs = [torch.randn(6, 40, generator=g).to(BF16) for _ in range(4)]
    as_ = [(b.float() + 1e-2 * torch.randn(6, 40, generator=g)).to(BF16) for b in bs]
    bs[3].zero_()
    as_[1][0, 3] = float("nan")
    as_[2][1, 1] = float("inf")
    units = [None, None, None, None]
    items = list(zip(as_, bs, units))
    got = resolve(compare_many(items, dims=("token", "channel")))
    alone = [resolve([compare_lazy(a, b, ("token", "channel"))])[0] for a, b in zip(as_, bs)]
    same = lambda x, y: repr(x) == repr(y)  # noqa: E731 - NaN values (worst_a) compare by text
    assert same(got, alone) and len({m["rel_l2"] for m in got}) == 4 and alone[1]["nan_a"] == 1
    unit = torch.full((6, 40), 2.0 ** -4, dtype=torch.float64)
    with_unit = resolve(compare_many([(a, b, unit) for a, b in zip(as_, bs)], detail=False))
    assert same(with_unit, [resolve([compare_lazy(a, b, detail=False, ulp_unit=unit)])[0] for a, b in zip(as_, bs)])
    batch = Batch()
    i = batch.add(as_[0], bs[0], ("token", "channel"))
    j = batch.add(as_[0][:3], bs[0][:3], detail=False)
    k = batch.add(as_[1], bs[1], ("token", "channel"))
    out = batch.run()
    assert same(out[i], alone[0]) and same(out[k], alone[1])
    assert out[j] == resolve([compare_lazy(as_[0][:3], bs[0][:3], detail=False)])[0]
    with pytest.raises(ShapeMismatch):
        batch.add(as_[0], bs[0][:3])
