"""fast.triton.tuning: the ROWS overrides of builds with few token rows, and bench_fast's
choice of TUNE and ROWS from per-S launch times (pure logic, no device)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fast.triton import tuning

pytestmark = pytest.mark.cpu


@pytest.fixture
def rows(monkeypatch):
    monkeypatch.setattr(tuning, "ROWS", {})
    return tuning.ROWS


def test_settings_uses_the_smallest_bound_at_or_above(rows, monkeypatch):
    monkeypatch.setitem(tuning.TUNE, "k1_split", 2)
    rows.update({1: dict(k1_split=1), 4: dict(k1_split=3)})
    assert tuning.settings(1)["k1_split"] == 1
    assert [tuning.settings(s)["k1_split"] for s in (2, 3, 4)] == [3, 3, 3]
    assert tuning.settings(5)["k1_split"] == 2 and tuning.settings(64)["k1_split"] == 2
    assert tuning.settings(1)["mid_warps"] == tuning.TUNE["mid_warps"]  # the rest is TUNE's
    rows.clear()
    assert tuning.settings(1) == tuning.TUNE


def test_shipped_rows_name_real_knobs():
    for m, over in tuning.ROWS.items():
        assert isinstance(m, int) and m >= 1
        assert set(over) <= set(tuning.TUNE), set(over) - set(tuning.TUNE)


def _bench_fast():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_fast.py"
    spec = importlib.util.spec_from_file_location("bench_fast_for_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pick_sets_tune_at_the_largest_s_and_rows_where_smaller_s_differs(monkeypatch):
    bf = _bench_fast()
    monkeypatch.setattr(tuning, "CANDIDATES", {("k1", 0): [{}, dict(k1_split=1), dict(k1_split=7, k1_bn=16)],
                                               ("k2", 1): [{}, dict(mid_warps=4)]})
    monkeypatch.setattr(tuning, "GROUPS", {("k1", 0): ("k1_split", "k1_bn"), ("k2", 1): ("mid_warps",)})
    base = dict(tuning.TUNE, k1_split=2, k1_bn=32, mid_warps=8, _rows={1: dict(up_warps=2), 2: dict(k1_bn=64)})
    scores = {
        (("k1", 0), 1): [(38.0, 0), (34.8, 1), (40.0, 2)],  # S = 1 prefers one split
        (("k1", 0), 8): [(38.3, 0), (42.7, 1), (37.0, 2)],  # S = 8: candidate 2 into TUNE
        (("k2", 1), 1): [(50.9, 0), (46.0, 1)],
        (("k2", 1), 8): [(58.8, 0), (70.0, 1)],
    }
    best, lines = bf.pick(base, scores, [1, 8])
    assert (best["k1_split"], best["k1_bn"], best["mid_warps"]) == (7, 16, 8)
    # ROWS[1]: the knobs in which S = 1's pick differs from the chosen TUNE (k1_bn 32 vs 16 too);
    # the old ROWS[1] is replaced (S = 1 was timed), ROWS[2] is kept (not timed)
    assert best["_rows"] == {1: dict(k1_split=1, k1_bn=32, mid_warps=4), 2: dict(k1_bn=64)}
    assert any("ROWS[1]" in ln for ln in lines)
    same, _ = bf.pick(base, {k: v for k, v in scores.items() if k[1] == 8} | {
        (("k1", 0), 1): [(30.0, 2)], (("k2", 1), 1): [(1.0, 0)]}, [1, 8])
    assert same["_rows"] == {2: dict(k1_bn=64)}, "a smaller S that picks the same adds no override"
