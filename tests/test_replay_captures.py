"""Replay tests parametrized over a folder of captures (the pytest plugin's `capture_set`):

    pytest -n 8 --captures golden/ [--backend triton] [--policy FILE]

Without --captures it replays the golden set through --backend (default: the reference).
"""
import pytest

pytestmark = pytest.mark.cpu


def test_capture_set_passes(capture_set, k3_replay):
    from harness.report import markdown

    run = k3_replay(capture_set)
    assert run.captures and run.captures[0].comparisons, "nothing was compared"
    assert run.passed, markdown(run)[:4000]
