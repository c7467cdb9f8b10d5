"""Triton backend, K1, in the CPU interpreter (tiny config) against the reference.

Bookkeeping outputs must be bit-exact (prefix after the delta add, the written block,
untouched cache slots and positions, the carried conv window); the rest within tight
tolerances. TRITON_INTERPRET=1 is set here before the kernels are first imported.
"""
from __future__ import annotations


import pytest
import torch

from triton_tier import backend, triton, tune  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import ref  # noqa: E402
from conftest import clone, make_k1  # noqa: E402
from ref import abi  # noqa: E402

pytestmark = pytest.mark.interpret


def _ulp_frac(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of elements differing by more than one bf16 ulp of b."""
    a, b = a.float(), b.float()
    e = torch.floor(torch.log2(b.abs().clamp_min(2.0 ** -100)))
    return float(((a - b).abs() > torch.exp2(e - 7) * 1.001).float().mean())


def _close(a: torch.Tensor, b: torch.Tensor, cos_min=0.9999, ulp_frac=0.01):
    assert torch.isfinite(a.float()).all(), "non-finite output"
    cos = torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0)
    assert cos >= cos_min, f"cosine {float(cos):.6f}"
    assert _ulp_frac(a, b) <= ulp_frac


def _exact_masks(key, kw):
    """conv_state entries / rstate slots that must come out bit-identical."""
    L, W = key.qlen, kw["conv_w"].shape[1]
    st, na = kw["st_idx"], kw["num_acc"]
    cs = torch.ones(kw["conv_state"].shape, dtype=torch.bool)
    rs = torch.ones(kw["rstate"].shape[0], dtype=torch.bool)
    for r in range(st.shape[0]):
        if st[r, 0] > 0:
            cs[st[r, 0], :, W - 2:W - 2 + L] = False  # new in_proj values: tolerance
        if st[r, na[r] - 1] > 0:
            for j in range(L):
                if st[r, j] > 0:
                    rs[st[r, j]] = False
    return cs, rs


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """Same values as a [slots, C, SL] view of a [slots, SL, C] buffer."""
    buf = torch.empty(t.shape[0], t.shape[2], t.shape[1], dtype=t.dtype)
    buf.copy_(t.transpose(1, 2))
    return buf.transpose(1, 2)


def _strided_slots(t: torch.Tensor) -> torch.Tensor:
    """Same values with the slot dim strided (every other slot of a bigger buffer)."""
    buf = torch.full((2 * t.shape[0],) + tuple(t.shape[1:]), 7.0, dtype=t.dtype)
    v = buf[::2]
    v.copy_(t)
    return v


def _run(backend, key, kw, poison=True):
    """(reference kwargs after, backend kwargs after, ref taps, backend taps)."""
    a, b = clone(kw), clone(kw)
    if poison:  # never-referenced slots: the backend must leave them bit-identical
        b["conv_state"][-2:] = float("nan")
        b["rstate"][-2:] = float("nan")
        b["core_out"].fill_(float("nan"))
    ta, tb = {}, {}
    ref.kda_pre(key, **a, taps=ta)
    backend.kda_pre(key, **b, taps=tb)
    return a, b, ta, tb


def _check(key, kw, a, b, ta, tb):
    assert torch.equal(b["prefix"], a["prefix"]), "prefix after the delta add"
    assert torch.equal(b["blocks"], a["blocks"]), "bank (written block and the rest)"
    cs, rs = _exact_masks(key, kw)
    spare = torch.zeros_like(cs)
    spare[-2:] = True
    bc, ac = b["conv_state"], a["conv_state"]
    assert torch.isnan(bc[spare]).all(), "an untouched conv slot was written"
    assert torch.equal(bc[cs & ~spare], ac[cs & ~spare]), "carried window / untouched conv entries"
    _close(bc[~cs], ac[~cs], ulp_frac=0.02)
    br, ar = b["rstate"], a["rstate"]
    assert torch.isnan(br[-2:]).all(), "an untouched recurrent slot was written"
    keep = rs.clone()
    keep[-2:] = False
    assert torch.equal(br[keep], ar[keep]), "untouched recurrent slots"
    if (~rs).any():
        _close(br[~rs], ar[~rs], cos_min=0.99999, ulp_frac=1.0)
    _close(b["core_out"], a["core_out"], ulp_frac=0.02)
    assert set(tb) == set(abi.K1_TAPS)
    for n in abi.K1_TAPS:
        assert tb[n].shape == ta[n].shape and tb[n].dtype == ta[n].dtype, n
    assert torch.equal(tb["x"], ta["x"]) or _ulp_frac(tb["x"], ta["x"]) < 0.01
    _close(tb["proj"], ta["proj"], ulp_frac=0.01)
    _close(tb["o"], ta["o"], ulp_frac=0.02)
    _close(tb["gate"], ta["gate"], cos_min=0.999999, ulp_frac=1.0)


@pytest.mark.parametrize("case", ["block_write_delta_padding", "gates_transposed", "plain_no_delta_strided",
                                  "qlen1_unmerged_split"])
def test_k1_matches_reference(backend, tune, k1_case, case):
    if case in ("block_write_delta_padding", "gates_transposed"):
        # layer 2 of tiny (block_size 2): writes bank row 1; every 2nd request is padding
        tune.update(k1_nv=2, k1_hc=48, rec_gt=case == "gates_transposed")  # 3 AttnRes chunks of 43, 43, 42 columns
        key, kw = k1_case(layer=2, R=4, L=3, with_delta=True, pad_every=2)
        assert key.write_idx == 1
    elif case == "plain_no_delta_strided":
        tune.update(k1_nv=1)
        key, kw = k1_case(layer=3, R=3, L=2, with_delta=False, sl_extra=2)
        kw["conv_state"] = _transposed(kw["conv_state"])
        kw["rstate"] = _strided_slots(kw["rstate"])
        assert key.write_idx == -1 and kw["conv_state"].stride(1) == 1
    else:
        tune.update(k1_split=2, k1_bk=32, k1_bn=16, k1_swap=True, k1_hc=32)  # 4 AttnRes chunks per row
        key, kw = k1_case(layer=5, R=5, L=1, with_delta=True, pad_every=3)
    a, b, ta, tb = _run(backend, key, kw)
    _check(key, kw, a, b, ta, tb)


def test_k1_scratch_reused_and_counters_reset(backend, tune, k1_case):
    """Second call of a build reuses its scratch; every handshake counter is back at 0."""
    from fast.triton import _host

    tune.update(k1_nv=2)
    key, kw = k1_case(layer=1, R=2, L=2)
    backend.kda_pre(key, **clone(kw))
    n = len(_host._SCRATCH)
    bufs = {k: {n: t.data_ptr() for n, t in v.items()} for k, v in _host._SCRATCH.items() if k[1] == key}
    backend.kda_pre(key, **clone(kw))
    assert len(_host._SCRATCH) == n
    for k, v in _host._SCRATCH.items():
        if k[1] == key:
            assert {n: t.data_ptr() for n, t in v.items()} == bufs[k]
            for c in ("ctr", "ctr_rec", "ctr_n"):
                assert int(v[c].abs().sum()) == 0, c


def test_k1_rejects_bad_shapes(backend, k1_case):
    key, kw = k1_case(R=2, L=2)
    kw = clone(kw)
    kw["w_in"] = kw["w_in"][:, :-1]
    with pytest.raises(abi.ArgError) as e:
        backend.kda_pre(key, **kw)
    assert e.value.field == "w_in"


def test_rows_overrides_reach_one_row_builds_only(backend, tune, k1_case, monkeypatch):
    """tuning.ROWS[1] changes the launch of a one-row build (its in_proj K split) and not of a
    two-row build; the one-row result still matches the reference."""
    from fast.triton import _host, _k1
    from fast.triton.tuning import ROWS

    tune.update(k1_split=2, k1_bk=32)
    ROWS[1] = dict(k1_split=1)
    seen = []
    real = _host._launch

    def spy(kernel, grid, *a, **kw):
        if kernel is _k1.k1_mid_kernel:
            seen.append(kw["SPLIT"])
        return real(kernel, grid, *a, **kw)

    monkeypatch.setattr(_host, "_launch", spy)
    key1, kw1 = k1_case(layer=1, R=1, L=1)
    out = _run(backend, key1, kw1)
    _check(key1, kw1, *out)
    key2, kw2 = k1_case(layer=1, R=2, L=1)
    _run(backend, key2, kw2)
    assert seen == [1, 2]


def test_rec_cap_halves_the_value_split(backend, tune, k1_case, monkeypatch):
    """TUNE rec_cap: a build whose requests·heads·k1_nv exceeds it launches the recurrence with
    k1_nv halved until it fits (here 3·2·2 = 12 > 6: one item per head), still matching the
    reference; under the cap the split stays."""
    from fast.triton import _host, _k1

    grids = []
    real = _host._launch

    def spy(kernel, grid, *a, **kw):
        if kernel is _k1.k1_rec_kernel:
            grids.append(tuple(grid))
        return real(kernel, grid, *a, **kw)

    monkeypatch.setattr(_host, "_launch", spy)
    tune.update(k1_nv=2, rec_cap=6)
    key, kw = k1_case(layer=2, R=3, L=2, with_delta=True)
    _check(key, kw, *_run(backend, key, kw))
    tune.update(rec_cap=12)
    _run(backend, key, kw)
    nh = kw["a_log"].shape[0]
    assert grids == [(3, nh, 1), (3, nh, 2)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("knob", ["k1_xc", "rec_flat", "rec_lean", "rec_hoist", "rec_ct", "rec_cnt", "k1_part", "k1_rst"])
def test_k1_layout_knobs_same_bits(backend, tune, k1_case, knob):
    """k1_xc (no AttnRes phase C: the in_proj items normalize x block by block, the rows' factor
    summed in the same chunk order), rec_flat (the token chain with q/k in the state's layout,
    the state-independent work first), rec_lean (q/k norms over [1, HD] rows, o stored after
    the chain) and rec_hoist (every token's conv outputs before the chain, the gated norm's g2
    rows and the q/k windows before its stores), rec_ct (the conv windows as [channels,
    positions] tiles), rec_cnt (the recurrence's wait a poll of stored in_proj row blocks),
    k1_part (in_proj's K-split partials summed where the recurrence reads them) and k1_rst
    (k1_mid's counters reset by the recurrence), flipped from their defaults, give the default
    launch's bits, every tap included, match the reference and leave the backend healthy."""
    from fast.triton.tuning import TUNE

    tune.update(k1_nv=2, k1_hc=48)
    if knob in ("k1_part", "k1_rst"):
        tune.update(k1_bk=32)  # 4 K blocks: in_proj split in 2
    if knob == "rec_cnt":
        tune.update(k1_part=False, k1_rst=False)  # rec_cnt's poll does not combine with them
    key, kw = k1_case(layer=2, R=4, L=3, with_delta=True, pad_every=2)
    _, b, _, tb = _run(backend, key, kw)
    tune.update(**{knob: not TUNE[knob]})
    _same_bits(backend, key, kw, b, tb)


def _same_bits(backend, key, kw, b, tb):
    """Another call matches the reference and gives the bits (b, taps tb) of the first, every tap
    included, and leaves the backend healthy (no handshake counter left behind, no wait gave up)."""
    a, c, ta, tc = _run(backend, key, kw)
    _check(key, kw, a, c, ta, tc)
    for n in ("prefix", "blocks", "conv_state", "rstate", "core_out"):
        assert torch.equal(_bits(c[n]), _bits(b[n])), n
    for n in tb:
        assert torch.equal(_bits(tc[n]), _bits(tb[n])), f"tap {n}"
    assert backend.health() == []


@pytest.mark.parametrize("over", [dict(k1_split=4, rec_flat=True), dict(k1_split=4, rec_gt=False, rec_hoist=False),
                                  dict(k1_split=2, rec_lean=False, rec_ct=False)])
def test_k1_part_and_rst_same_bits(backend, tune, k1_case, over):
    """k1_part and k1_rst together, over a K split of 2 and 4 (the sum's order shows from 3 partials
    on) and every path of the recurrence that reads in_proj rows (the flat chain's scalar beta, the
    gates' [LP, HD] MMA, the unhoisted windows and g2 rows), give the plain launch's bits, taps
    included, twice in a row (the second call runs on the counters the first one's recurrence reset)."""
    tune.update(k1_nv=2, k1_hc=48, k1_bk=32, k1_part=False, k1_rst=False, **over)
    key, kw = k1_case(layer=2, R=4, L=3, with_delta=True, pad_every=2)
    _, b, _, tb = _run(backend, key, kw)
    tune.update(k1_part=True, k1_rst=True)
    for _ in range(2):
        _same_bits(backend, key, kw, b, tb)


def test_k1_rst_counters_survive_a_failed_recurrence_launch(backend, tune, k1_case, monkeypatch):
    """With k1_rst the recurrence resets k1_mid's counters: a recurrence launch that raises leaves
    them reset by the host, so the next call still matches the plain launch; rec_cnt with k1_part
    or k1_rst is refused, naming both."""
    from fast.triton import _host, _k1

    tune.update(k1_nv=2, k1_hc=48, k1_bk=32, k1_part=False, k1_rst=False)
    key, kw = k1_case(layer=2, R=2, L=2, with_delta=True)
    _, b, _, _ = _run(backend, key, kw)
    tune.update(k1_part=True, k1_rst=True)
    real = _host._launch

    def boom(kernel, grid, *a, **k):
        if kernel is _k1.k1_rec_kernel:
            raise RuntimeError("planted launch failure")
        return real(kernel, grid, *a, **k)

    monkeypatch.setattr(_host, "_launch", boom)
    with pytest.raises(RuntimeError, match="planted"):
        backend.kda_pre(key, **clone(kw))
    monkeypatch.setattr(_host, "_launch", real)
    assert backend.health() == []
    _, c, _, _ = _run(backend, key, kw)
    assert torch.equal(_bits(c["core_out"]), _bits(b["core_out"]))
    tune.update(rec_cnt=1)
    with pytest.raises(ValueError, match="rec_cnt.*k1_part or k1_rst"):
        backend.kda_pre(key, **clone(kw))
