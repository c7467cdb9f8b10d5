"""harness.results / harness.report: Markdown summary and table, JSON schema round trip,
HTML with embedded plots (and without matplotlib), and `k3verify diff`."""
from __future__ import annotations

import base64
import json
import re
import sys

import pytest
import torch

from harness import report
from harness.cli import main as k3verify
from harness.errors import InputError
from harness.metrics import compare
from harness.policy import Policy
from harness.results import SCHEMA, CaptureResult, Comparison, Run

pytestmark = pytest.mark.cpu
BF16 = torch.bfloat16

POLICY = Policy({"stage": {
    "k1": {"prefix": {"exact": True}, "core_out": {"rel_l2_max": 5e-3, "oracle_k": 2.0}},
    "k2": {"y": {"rel_l2_max": 5e-3, "cosine_min": 0.9999}, "out": {"rel_l2_max": 5e-3}},
    "untouched": {"rstate": {"exact": True, "finite": False}}}})


def _pair(rng, shape, err):
    b = torch.randn(*shape, generator=rng).to(BF16)
    a = (b.float() * (1 + err * torch.randn(*shape, generator=rng))).to(BF16)
    return a, b


def make_run(rng, *, bad_y: float = 0.0, with_second: bool = True) -> Run:
    """Two capture sets, two ranks, four steps of K2 `out`; capture 1 has a bad `y` on rank 1."""
    run = Run(backend="fake", device="cpu", arch="x86_64", env={"torch": torch.__version__, "git": "abc123"},
              policy="<memory>", options={"isolate": False, "noise": 0})
    ids = ["s0000_l001", "s0001_l001"] if with_second else ["s0000_l001"]
    for i, cid in enumerate(ids):
        cap = CaptureResult(id=cid, fmt="mxfp4", layer=1, kind="kda", step=i, world=2)
        for rank in range(2):
            common = dict(capture=cid, layer=1, kind="kda", step=i, rank=rank, fmt="mxfp4", policy=POLICY)
            a, b = _pair(rng, (4, 32), 1e-4)
            cap.comparisons.append(Comparison.judged(stage="k1", output="prefix", view="chained",
                                                     metrics=compare(b.clone(), b, "prefix"), **common))
            a, b = _pair(rng, (4, 32), 1e-4)
            o = b.double() * (1 + 1e-2 * torch.randn(4, 32, generator=rng, dtype=torch.float64))
            cap.comparisons.append(Comparison.judged(
                stage="k1", output="core_out", view="chained", metrics=compare(a, b, "core_out"),
                oracle={"fast": compare(a, o), "ref": compare(b, o)}, **common))
            err = bad_y if (i == 1 and rank == 1) else 1e-4
            a, b = _pair(rng, (4, 64), err)
            cap.comparisons.append(Comparison.judged(stage="k2", output="y", view="chained",
                                                     metrics=compare(a, b, "y"), **common))
            a, b = _pair(rng, (4, 32), 1e-4)
            cap.comparisons.append(Comparison.judged(stage="k2", output="out", view="chained",
                                                     metrics=compare(a, b, "out"), **common))
            st = torch.randn(3, 2, 4, 4, generator=rng)
            cap.comparisons.append(Comparison.judged(stage="untouched", output="rstate", view="chained",
                                                     metrics=compare(st.clone(), st, "rstate"), **common))
        cap.missing_taps = {"k1": ["gate", "beta"], "k2": []}
        cap.timings = {"load": 0.01, "run": 0.2, "judge": 0.02}
        run.captures.append(cap)
    run.duration_s = 0.5
    return run


def test_markdown_summary_and_table(rng):
    run = make_run(rng, bad_y=0.05)
    md = report.markdown(run)
    lines = md.splitlines()
    summary = next(ln for ln in lines if ln.startswith("**"))
    assert re.fullmatch(r"\*\*FAIL\*\* · backend `fake` · device cpu \(x86_64\) · 2 captures \(1 failed\)"
                        r" · 20 comparisons \(1 failed\)", summary), summary
    header = next(ln for ln in lines if ln.startswith("| stage "))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols == list(report.TABLE_COLUMNS)
    assert cols == ["stage", "criterion (metric)", "worst value", "reference's own", "limit", "margin", "used",
                    "worst location", "captures failing"]
    rows = {r["stage"] + "/" + r["output"]: r for r in report.stage_rows(run)}
    y = rows["k2/y"]
    assert not y["passed"] and y["captures_failing"] == 1 and y["captures"] == 2
    assert y["criterion"] in ("rel_l2_max", "cosine_min") and y["margin"] < 0
    assert y["location"].startswith("s0001_l001 r1 token=")  # the failing capture, rank, named dims
    assert y["label"] == "k2 · routed experts (y)"
    assert rows["k1/prefix"]["criterion"] == "exact" and rows["k1/prefix"]["passed"]
    assert rows["k1/prefix"]["location"] == "—"  # exact and equal: no worst location
    co = rows["k1/core_out"]  # an oracle-ratio row shows the reference's own error beside the backend's
    if co["criterion"] == "oracle_k":
        assert co["ref_own"] is not None and co["ref_own"] > 0
    row_y = next(ln for ln in lines if "(y)" in ln and ln.startswith("|"))
    assert "**FAIL**" in row_y and "1/2" in row_y and "(rel_l2)" in row_y or "(cosine)" in row_y
    born = report.problem_lines(run)
    assert born == ["s0001_l001: born at k2 · routed experts (y) rank 1: " + born[0].split("rank 1: ", 1)[1]]
    assert "### Where the errors were born" in md
    assert md.count("<details>") == 2 and md.count("</details>") == 2
    assert "taps the backend does not expose" in md.lower() and "gate, beta" in md
    assert "### Environment" in md and "abc123" in md
    # a passing run says PASS
    ok = report.summary_line(make_run(rng))
    assert ok.startswith("**PASS** · backend `fake`")


TOP_KEYS = {"schema", "backend", "device", "arch", "env", "policy", "options", "started", "duration_s",
            "summary", "captures"}
SUMMARY_KEYS = {"passed", "captures", "captures_failed", "comparisons", "comparisons_failed", "criteria",
                "criteria_failed", "criteria_skipped", "errors", "aborted"}
CAPTURE_KEYS = {"id", "fmt", "layer", "kind", "step", "world", "passed", "missing_taps", "timings", "errors",
                "notes", "aborted", "comparisons"}
COMPARISON_KEYS = {"capture", "layer", "kind", "step", "rank", "stage", "output", "view", "passed", "metrics",
                   "criteria", "oracle", "noise", "note"}
CRITERION_KEYS = {"name", "metric", "value", "limit", "margin", "passed", "used", "skipped", "note"}
METRIC_KEYS = {"n", "shape", "dtype_a", "dtype_b", "dtype_match", "exact", "n_differ", "exact_frac", "max_abs",
               "mean_abs", "rel_l2", "cosine", "sqnr_db", "calc_diff", "scale_err", "max_ulp", "mismatch_frac",
               "atol", "rtol", "atol_rms", "nan_a", "inf_a", "nan_b", "inf_b", "ref_absmax", "ref_rms", "worst",
               "worst_a", "worst_b", "worst_ulp", "ulp_hist", "mag_err"}


def _strict(text: str):
    def no_constant(c):
        raise AssertionError(f"non-standard JSON constant {c}")
    return json.loads(text, parse_constant=no_constant)


def test_json_schema_and_round_trip(rng, tmp_path):
    run = make_run(rng, bad_y=0.05)
    p = run.save(tmp_path / "r.json")
    d = _strict(p.read_text())
    assert set(d) == TOP_KEYS and d["schema"] == SCHEMA
    assert set(d["summary"]) == SUMMARY_KEYS and d["summary"]["comparisons_failed"] == 1
    cap = d["captures"][1]
    assert set(cap) == CAPTURE_KEYS and cap["passed"] is False
    comp = cap["comparisons"][0]
    assert set(comp) == COMPARISON_KEYS
    assert set(comp["criteria"][0]) == CRITERION_KEYS
    assert set(comp["metrics"]) == METRIC_KEYS
    assert comp["metrics"]["sqnr_db"] == "inf"  # prefix vs itself: non-finite floats travel as strings
    back = Run.load(p)
    assert back.to_dict() == run.to_dict()
    assert back.comparisons[0].metrics["sqnr_db"] == float("inf")
    assert back.passed is False and back.captures[1].failed[0].output == "y"


def test_json_bad_input(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        Run.load(p)
    p.write_text('{"schema": "other/9"}')
    with pytest.raises(InputError, match="not a k3verify report"):
        Run.load(p)


def test_html_has_images(rng, tmp_path):
    pytest.importorskip("matplotlib")
    run = make_run(rng, bad_y=0.05)
    out = report.write_html(run, tmp_path / "r.html")
    page = out.read_text()
    imgs = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(imgs) == 6  # k1 and k2: histogram, error vs magnitude, drift
    assert all(base64.b64decode(s)[:8] == b"\x89PNG\r\n\x1a\n" for s in imgs)
    assert "FAIL" in page and "<table>" in page


def test_html_without_matplotlib(rng, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    run = make_run(rng)
    notes = report.write_reports(run, md=tmp_path / "r.md", json=tmp_path / "r.json", html=tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "<img" not in page and report.NO_MPL_NOTE in page
    assert notes and "matplotlib" in notes[0]
    assert (tmp_path / "r.md").read_text().startswith("## k3verify replay")
    assert Run.load(tmp_path / "r.json").passed


def test_diff_judges_against_the_limits(rng, tmp_path, capsys):
    from harness import diff

    base = make_run(torch.Generator().manual_seed(1))
    worse = make_run(torch.Generator().manual_seed(1), bad_y=0.05)
    d = diff.diff_runs(base, worse)
    assert d.worse
    assert any("routed experts (y)" in r and "now fails" in r for r in d.regressions), d.regressions
    bad = {(r["stage"], r["output"]) for r in d.rows if r["worse"]}
    assert bad == {("k2", "y")}
    assert not diff.diff_runs(base, make_run(torch.Generator().manual_seed(1))).worse
    pa, pb = base.save(tmp_path / "a.json"), worse.save(tmp_path / "b.json")
    assert diff.cli([str(pa), str(pb)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("WORSE") and "(y)" in out
    assert diff.cli([str(pb), str(pa)]) == 0  # the other way round it got better: an improvement
    out = capsys.readouterr().out
    assert "no regression" in out and "better" in out
    # coverage lost is a regression: B has only one of the two captures
    pc = make_run(torch.Generator().manual_seed(1), with_second=False).save(tmp_path / "c.json")
    assert diff.cli([str(pa), str(pc)]) == 1
    assert "missing in the new report" in capsys.readouterr().out


def test_diff_margin_is_a_share_of_the_budget(rng):
    """Two passing runs: a criterion moving from 10% to 30% of its budget is within the default
    margin (a quarter of the budget), from 10% to 60% is not; noise far below the limit never is."""
    from harness import diff

    def one(err):
        run = Run(backend="fake", device="cpu")
        cap = CaptureResult(id="s0000_l001", fmt="bf16", layer=1, kind="kda", step=0, world=1)
        b = torch.randn(64, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        a = b * (1 + err)
        cap.comparisons.append(Comparison.judged(POLICY, capture=cap.id, layer=1, kind="kda", step=0, rank=0,
                                                 stage="k2", output="out", view="chained", fmt="bf16",
                                                 metrics=compare(a, b, "out")))
        run.captures.append(cap)
        return run

    lim = 5e-3
    r10, r30, r60 = one(0.1 * lim), one(0.3 * lim), one(0.6 * lim)
    assert all(c.passed for r in (r10, r30, r60) for c in r.comparisons)
    assert not diff.diff_runs(r10, r30).worse
    assert diff.diff_runs(r10, r60).worse and diff.diff_runs(r10, r60, margin=0.6).worse is False
    assert not diff.diff_runs(r60, r10).worse  # an improvement
    assert not diff.diff_runs(one(1e-9), one(1e-7)).worse  # 100x the error, still ~0% of the budget


def test_diff_bad_input(tmp_path, capsys, rng):
    assert k3verify(["diff", str(tmp_path / "none.json"), str(tmp_path / "none2.json")]) == 2
    assert "not found" in capsys.readouterr().err
    good = make_run(rng).save(tmp_path / "good.json")
    binary = tmp_path / "bin.json"
    binary.write_bytes(bytes(range(256)) * 4)
    nulls = json.loads(good.read_text())
    nulls["captures"][0]["comparisons"][0]["metrics"] = None
    (tmp_path / "null.json").write_text(json.dumps(nulls))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    for bad, field in ((binary, "report"), (tmp_path / "null.json", "metrics"), (deep, "json")):
        assert k3verify(["diff", str(good), str(bad)]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and field in err[0], err
    assert k3verify(["diff", "only-one.json"]) == 2
