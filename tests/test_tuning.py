"""fast.triton.tuning: the ROWS overrides of builds with few token rows, and bench_fast's
choice of TUNE and ROWS from per-S launch times (pure logic, no device)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

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


def _bench(name: str = "bench_fast"):
    """benchmarks/<name>.py as a module (the benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_for_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pick_sets_tune_at_the_largest_s_and_rows_where_smaller_s_differs(monkeypatch):
    bf = _bench()
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


def test_env_overrides_win_over_tune_and_rows(monkeypatch):
    monkeypatch.setattr(tuning, "ROWS", {1: dict(k1_stages=4, k1_nv=8)})
    monkeypatch.setenv(tuning.ENV, "k1_stages=5, rec_lean=false,poll_nap=0x190")
    s1, s8 = tuning.settings(1), tuning.settings(8)
    assert (s1["k1_stages"], s1["k1_nv"], s1["rec_lean"], s1["poll_nap"]) == (5, 8, False, 400)
    assert (s8["k1_stages"], s8["k1_nv"], s8["rec_lean"]) == (5, tuning.TUNE["k1_nv"], False)
    monkeypatch.delenv(tuning.ENV)
    assert tuning.settings(8) == tuning.TUNE and tuning.settings(1)["k1_stages"] == 4


@pytest.mark.parametrize("text, names", [("k1_splitt=4", "'k1_splitt'"), ("k1_split", "'k1_split'"),
                                         ("k1_split=four", "k1_split='four'"), ("rec_lean=2", "rec_lean='2'"),
                                         ("rec_cnt=1", "rec_cnt=1 cannot be combined with k1_part or k1_rst")])
def test_env_override_errors_name_the_knob(monkeypatch, text, names):
    from fast.triton import BACKEND
    from harness.errors import InputError
    from harness.replay import checked_backend

    monkeypatch.setenv(tuning.ENV, text)
    with pytest.raises(ValueError, match=tuning.ENV) as e:
        tuning.settings(1)
    assert names in str(e.value) and "\n" not in str(e.value)
    ok, why = BACKEND.available()
    assert not ok and names in why
    with pytest.raises(InputError) as e:  # the CLI's exit 2, one line naming --backend and the knob
        checked_backend("triton")
    assert e.value.field == "--backend" and names in str(e.value)


def test_env_override_in_the_backend_version(monkeypatch):
    from fast.triton import BACKEND

    monkeypatch.delenv(tuning.ENV, raising=False)
    plain = BACKEND.version
    monkeypatch.setenv(tuning.ENV, "poll_nap=400")
    assert BACKEND.version == f"{plain} (K3VERIFY_TRITON_TUNE=poll_nap=400)"


def test_bench_adopts_the_override_as_tune(monkeypatch):
    bf = _bench()
    monkeypatch.setattr(tuning, "TUNE", dict(tuning.TUNE, k1_stages=6, poll_nap=0))
    monkeypatch.setattr(tuning, "ROWS", {1: dict(k1_stages=4, k1_nv=8)})
    monkeypatch.setenv(tuning.ENV, "k1_stages=5,poll_nap=400")
    assert bf.adopt_env() == dict(k1_stages=5, poll_nap=400)
    assert (tuning.TUNE["k1_stages"], tuning.TUNE["poll_nap"]) == (5, 400)
    assert tuning.ROWS == {1: dict(k1_nv=8)}, "the override holds at every S"
    assert tuning.ENV not in os.environ, "variants and compile workers apply over it, not under it"


def test_bench_k1_best_needs_a_clear_win():
    b = _bench("bench_k1")

    def row(v, r44, r84, bad=()):
        return dict(variant=v, cases={"4x4": dict(us=r44 * 23, floor=23, bad=list(bad)),
                                      "8x4": dict(us=r84 * 24, floor=24, bad=[])})
    table = [row({}, 2.03, 2.02), row(dict(poll_nap=400), 1.97, 1.99), row(dict(poll_nap=1500), 1.95, 2.03),
             row(dict(k1_split=4), 1.90, 1.90, bad=["core_out"])]
    assert b.best(table) == dict(poll_nap=400), "the worst case decides; a failed check never wins"
    assert b.best([row({}, 2.03, 2.02), row(dict(k1_split=4), 2.025, 2.015)]) == {}, "inside the spread: defaults"
    assert b.best([row({}, 2.0, 2.0)]) == {}


def test_the_suite_refuses_to_run_with_an_override():
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, K3VERIFY_TRITON_TUNE="poll_nap=400", PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root),
                        "-c", str(root / "pyproject.toml"), "--confcutdir", str(root / "tests"),
                        str(root / "tests" / "test_tuning.py::test_shipped_rows_name_real_knobs")],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "K3VERIFY_TRITON_TUNE is set" in r.stdout + r.stderr


def test_bench_variants_parse_as_the_override_does():
    assert tuning.parse_knobs("k1_split=4,rec_lean=0,poll_nap=400", "--variants") == dict(
        k1_split=4, rec_lean=False, poll_nap=400)
    with pytest.raises(ValueError, match=r"^--sweep: 'k1_spilt' is not a TUNE knob"):
        tuning.parse_knobs("k1_spilt=4", "--sweep")


@pytest.mark.parametrize("occ,warps,cap", [(3, 4, 168), (2, 4, 255), (4, 4, 128), (3, 8, 80), (1, 4, 255)])
def test_rec_occ_caps_registers_so_occ_programs_fit(occ, warps, cap):
    """rec_occ's cap: occ programs of `warps` warps within an SM's 65536 registers, allocated
    per warp in 256-register units (so a multiple of 8 per thread), never above ptxas' 255."""
    from fast.triton import _host

    got = _host._occ(torch.device("cuda"), occ, warps)["maxnreg"]
    assert got == cap
    assert occ * warps * 32 * got <= 65536 and (got % 8 == 0 or got == 255)
    assert got == 255 or occ * warps * 32 * (got + 8) > 65536  # the largest that fits
    assert _host._occ(torch.device("cpu"), occ, warps) == {} and _host._occ(torch.device("cuda"), 0, warps) == {}
