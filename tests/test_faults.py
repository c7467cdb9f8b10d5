"""Faults and bad input around a replay (issue M): every failure is one clear line with its exit
code, nothing hangs, nothing is lost.

Exit codes: 0 pass, 1 numerics failed, 2 bad input or usage, 3 the harness could not finish."""
from __future__ import annotations

import re

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.capture import discover
from harness.cli import main
from harness.errors import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_PASS, EXIT_USAGE
from harness.replay import replay

pytestmark = pytest.mark.cpu
pytest_plugins = ["pytester"]
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GOLDEN = ROOT / "golden" / "set"


@pytest.fixture(autouse=True)
def _tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


@pytest.fixture(scope="module")
def sets():
    return discover(GOLDEN)


def _kda(sets):
    from harness.capture import load_set

    return [p for p in sets if load_set(p).kind == "kda"]


def test_hung_backend_fails_its_capture_and_the_run_goes_on(sets):
    two = _kda(sets)[:2]
    t0 = time.monotonic()
    run = replay(two, "planted:HUNG", "cpu", progress=False, timeout=1.0)
    took = time.monotonic() - t0
    assert [c.aborted is not None for c in run.captures] == [True, True]  # each hit the limit; none skipped
    assert "did not finish within 1 s" in run.captures[0].aborted
    assert run.exit_code() == EXIT_INCOMPLETE and not run.passed
    assert took < 30, took


def test_hung_rank_does_not_outlive_the_limit(sets):
    from harness.capture import load_set

    k2 = [p for p in sets if load_set(p).has_k2][:1]
    t0 = time.monotonic()
    run = replay(k2, "planted:HUNG_RANK", "cpu", progress=False, timeout=1.5)
    assert run.captures[0].aborted and time.monotonic() - t0 < 30
    assert run.exit_code() == EXIT_INCOMPLETE


def test_run_world_names_the_hung_rank():
    from ref.comm import SimWorld, run_world

    comm = SimWorld(2)

    def body(r):
        if r == 1:
            time.sleep(3600)
        return r

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of 2"):
        run_world(2, body, comm, timeout=0.5)
    assert time.monotonic() - t0 < 5


def test_cli_timeout_exit_code(sets, capsys):
    code = main(["replay", str(_kda(sets)[0]), "--backend", "planted:HUNG", "--timeout", "1", "--quiet"])
    out = capsys.readouterr().out
    assert code == EXIT_INCOMPLETE
    assert "not finished" in out and "did not finish within 1 s" in out


def test_hung_test_does_not_wedge_the_xdist_node(pytester, sets, monkeypatch):
    """Under `pytest -n 2` the hung backend's test fails by its limit; the tests after it run."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(ROOT)]))
    pytester.makepyfile(test_hang=f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from pathlib import Path
SET = Path({str(_kda(sets)[0])!r})

def test_a_hung(k3_replay):
    run = k3_replay(SET, timeout=1.0)
    assert run.passed, run.captures[0].aborted

def test_b_after(k3_replay):
    assert k3_replay(SET, timeout=1.0).passed

def test_c_after():
    pass
""")
    # a wedged node never reports test_c_after, and the run's own timeout (a hang guard, not a
    # speed goal) raises
    r = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "--backend", "planted:HUNG", timeout=300)
    r.assert_outcomes(failed=2, passed=1)  # both replays hit the limit; the node went on to the third test
    assert "did not finish within 1 s" in r.stdout.str()
    r = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", timeout=300)
    r.assert_outcomes(passed=3)


def test_backend_writing_its_weights_is_caught(sets):
    run = replay(_kda(sets)[:1], "planted:SCRIBBLER", "cpu", progress=False)
    assert run.exit_code() == EXIT_FAIL
    assert any("wrote into its read-only input w_in" in e for e in run.captures[0].errors)


def test_unhealthy_backend_fails_with_the_reason(sets, capsys):
    code = main(["replay", str(_kda(sets)[0]), "--backend", "planted:UNHEALTHY", "--quiet"])
    out = capsys.readouterr().out
    assert code == EXIT_FAIL and "backend health: k1 attnres+in_proj: ticket wait timed out" in out


def test_tap_of_the_wrong_shape_is_an_error_line(sets, capsys):
    code = main(["replay", str(_kda(sets)[0]), "--backend", "planted:BAD_TAP", "--quiet"])
    out, err = capsys.readouterr()
    assert code == EXIT_FAIL and "Traceback" not in out + err
    assert re.search(r"k1/x \(tap\) rank 0: the backend's tensor has the wrong shape \((\d+), 127\), "
                     r"expected \(\1, 128\)", out), out


def test_backend_raising_is_shown_on_the_terminal(sets, capsys, tmp_path):
    (tmp_path / "boom_backend.py").write_text(
        "class B:\n    def kda_pre(self, key, **a):\n        raise RuntimeError('kernel launch failed: bad grid')\n"
        "    def k2_launch(self, key, **a):\n        raise RuntimeError('no')\nB = B()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        code = main(["replay", str(_kda(sets)[0]), "--backend", "boom_backend:B", "--quiet"])
    finally:
        sys.path.remove(str(tmp_path))
    out = capsys.readouterr().out
    assert code == EXIT_FAIL and "kernel launch failed: bad grid" in out


@pytest.mark.parametrize("body,msg", [
    ("raise ValueError('broken at import')", "raised ValueError: broken at import"),
    ("class B:\n    def kda_pre(self, k, **a): pass\n    def k2_launch(self, k, **a): pass\n"
     "    def available(self): raise OSError('probe crashed')\nB = B()", "available() raised OSError: probe crashed"),
])
def test_backends_that_raise_on_import_or_probe(tmp_path, capsys, sets, body, msg):
    name = f"bad_backend_{abs(hash(body)) % 10 ** 6}"
    (tmp_path / f"{name}.py").write_text(body + "\n")
    sys.path.insert(0, str(tmp_path))
    try:
        code = main(["replay", str(sets[0]), "--backend", f"{name}:B", "--quiet"])
    finally:
        sys.path.remove(str(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USAGE and len(err) == 1 and msg in err[0], err


@pytest.mark.parametrize("args,field", [
    (["--device", "bogus"], "--device"),
    (["--device", "cuda"], "--device"),
    (["--limit", "-1"], "--limit"),
    (["--limit", "0"], "--limit"),
    (["--timeout", "-3"], "--timeout"),
    (["--noise", "x"], "arguments"),
])
def test_bad_arguments(sets, capsys, args, field):
    import torch

    if args[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    assert main(["replay", str(sets[0]), "--quiet", *args]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err


def test_report_targets_checked_before_the_run(sets, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    try:
        for opt, target in (("--json", ro / "r.json"), ("--report", a_file / "r.md"), ("--html", tmp_path)):
            if opt == "--json" and os.access(ro, os.W_OK):
                continue  # running as a user who can write anywhere (root): the permission case cannot show
            t0 = time.monotonic()
            assert main(["replay", str(sets[0]), "--quiet", opt, str(target)]) == EXIT_USAGE
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and opt in err[0], err
            assert time.monotonic() - t0 < 5  # refused before any replay work
    finally:
        ro.chmod(0o700)


def test_report_write_failure_after_the_run_is_exit_3(sets, tmp_path, monkeypatch, capsys):
    from harness import report

    def full_disk(run, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_markdown", full_disk)
    code = main(["replay", str(sets[0]), "--quiet", "--report", str(tmp_path / "r.md"), "--json",
                 str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == EXIT_INCOMPLETE and "No space left on device" in out
    assert (tmp_path / "r.json").is_file()  # the other report is still written


def test_closed_pipe_keeps_the_report(sets, tmp_path):
    """`replay ... | head -1`: no BrokenPipe traceback, the report is written, the verdict is the exit code."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = (f"{sys.executable} -m harness.cli replay {sets[0]} --quiet --report {tmp_path / 'r.md'} | head -1; "
           "exit ${PIPESTATUS[0]}")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == EXIT_PASS, r.stderr
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr
    assert r.stdout.startswith("**PASS**")
    assert (tmp_path / "r.md").read_text().startswith("## k3verify replay")


def test_deep_policy_toml_is_an_error(sets, tmp_path, capsys):
    p = tmp_path / "deep.toml"
    p.write_text("x = " + "[" * 50000 + "]" * 50000 + "\n")
    assert main(["replay", str(sets[0]), "--quiet", "--policy", str(p)]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "policy" in err[0]


def test_reading_the_revision_takes_no_git_lock(tmp_path):
    """The report's git revision must not write into the checkout (no index refresh, no lock)."""
    from harness.results import git_revision

    repo = tmp_path / "repo"
    repo.mkdir()
    run = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (repo / "f").write_text("a")
    run("add", "f")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    time.sleep(1.1)
    os.utime(repo / "f")  # stat-dirty: a plain `git status` would rewrite .git/index
    idx = repo / ".git" / "index"
    before = (idx.stat().st_mtime_ns, idx.read_bytes())
    assert git_revision(repo)
    assert (idx.stat().st_mtime_ns, idx.read_bytes()) == before
    assert not (repo / ".git" / "index.lock").exists()


def test_weight_checksum_in_chunks_sees_one_word(monkeypatch):
    """The weight checksum runs in bounded chunks (no int64 copy of a 2 GB weight): chunked or
    not it is the same sum, and one changed 32-bit word anywhere changes it."""
    import torch

    from harness import engine

    t = torch.randint(-2 ** 31, 2 ** 31 - 1, (1001,), dtype=torch.int32).view(torch.bfloat16)[:2001]
    whole = engine._checksum(t)
    monkeypatch.setattr(engine, "_CHUNK_WORDS", 8)
    assert torch.equal(engine._checksum(t), whole)
    for i in (0, 7, 8, 999, 2000):
        u = t.clone()
        u.view(torch.int16)[i] ^= 1
        assert not torch.equal(engine._checksum(u), whole), i


def test_a_scribbler_does_not_poison_later_sets(sets):
    """The weights are shared by every set of a layer (the loader's cache): after a backend
    wrote into them, the next replay in the same process gets pristine weights, so an honest
    backend is not blamed."""
    from harness.replay import replay

    kda = _kda(sets)[:1]
    assert not replay(kda, "planted:SCRIBBLER", "cpu", progress=False).passed
    run = replay(kda, "ref", "cpu", progress=False)
    assert run.passed, [c.errors for c in run.captures]
