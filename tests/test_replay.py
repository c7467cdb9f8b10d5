"""Replay end to end: the reference passes the golden set; broken backends fail with the
stage that broke named; the CLI's exit codes."""
from pathlib import Path

import pytest

from harness.capture import discover
from harness.cli import main
from harness.replay import replay

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "golden"


@pytest.fixture(scope="module")
def kda_sets():
    """The golden KDA sets (K1 then K2), in discovery order."""
    from harness.capture import load_set

    sets = [p for p in discover(GOLDEN) if load_set(p).kind == "kda"]
    assert sets, "the golden set is missing"
    return sets


@pytest.fixture(autouse=True)
def _tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def _failed(run):
    return {(c.stage, c.output, c.view) for c in run.comparisons if not c.passed}


def test_reference_passes_golden(kda_sets):
    run = replay(kda_sets, "ref", "cpu", progress=False, isolate=True)
    assert run.passed, _failed(run)
    names = {(c.stage, c.output) for c in run.comparisons}
    for must in [("k1", "core_out"), ("k1", "conv_carry"), ("untouched", "rstate"), ("k2", "out"),
                 ("k2", "out_ranks"), ("k2", "topk_ids"), ("untouched", "k2_blocks")]:
        assert must in names, must


def test_stray_slot_write_fails_untouched(kda_sets):
    run = replay(kda_sets[:3], "broken_backends:STRAY", "cpu", progress=False)
    bad = _failed(run)
    assert ("untouched", "rstate", "chained") in bad
    assert all(s == "untouched" for s, _, _ in bad), bad


def test_gated_norm_error_is_born_at_core_out(kda_sets):
    run = replay(kda_sets[:3], "broken_backends:GATED", "cpu", progress=False, isolate=True)
    bad = _failed(run)
    assert ("k1", "core_out", "isolated") in bad
    assert ("k1", "o", "isolated") not in bad and ("k1", "o", "chained") not in bad


def test_latent_norm_error_is_born_at_ln(kda_sets):
    run = replay(kda_sets[:3], "broken_backends:LATENT", "cpu", progress=False, isolate=True)
    bad = _failed(run)
    assert ("k2", "ln", "isolated") in bad and ("k2", "out", "chained") in bad
    assert not any(o in ("y", "lat", "x", "delta") for _, o, _ in bad), bad


def test_unwritten_output_fails(kda_sets):
    run = replay(kda_sets[:1], "broken_backends:NOWRITE", "cpu", progress=False)
    assert ("k1", "core_out", "chained") in _failed(run)


def test_cli_exit_codes(tmp_path, capsys, kda_sets):
    one = str(kda_sets[0])
    assert main(["replay", one, "--backend", "ref", "--quiet", "--report", str(tmp_path / "r.md"),
                 "--json", str(tmp_path / "r.json")]) == 0
    assert (tmp_path / "r.md").read_text().startswith("**PASS**") or "PASS" in (tmp_path / "r.md").read_text()
    assert main(["replay", one, "--backend", "broken_backends:STRAY", "--quiet"]) == 1
    assert main(["replay", str(tmp_path / "nope"), "--quiet"]) == 2
    assert main(["replay", one, "--backend", "no_such_module:X", "--quiet"]) == 2
    assert main(["replay", one, "--noise", "-1"]) == 2
    assert main(["replay", one, "--verify", "full", "--quiet"]) == 0
    assert main(["replay", one, "--verify", "sometimes", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--backend" in err and "captures" in err


def test_noise_runs_are_judged(kda_sets):
    run = replay(kda_sets[:1], "ref", "cpu", progress=False, noise=2)
    assert run.passed
    assert any(c.noise for c in run.comparisons)


def test_retire_layers_empties_the_cache_at_each_new_layer(monkeypatch, tmp_path):
    """Corpus order never returns to a layer: its weights leave the cache when the next
    (folder, layer) starts, and not between the steps of one layer."""
    from harness.capture.sources import CACHE
    from harness.replay import corpus_order, retire_layers

    names = ["s00001_l002", "s00000_l001", "s00001_l001", "s00000_l002"]
    paths = [tmp_path / "a" / n for n in names] + [tmp_path / "b" / "s00000_l002"]
    seen = []
    monkeypatch.setattr(CACHE, "clear", lambda: seen.append("clear"))
    for p in retire_layers(corpus_order(paths)):
        seen.append(f"{p.parent.name}/{p.name}")
    assert seen == ["a/s00000_l001", "a/s00001_l001", "clear", "a/s00000_l002", "a/s00001_l002", "clear",
                    "b/s00000_l002"]
