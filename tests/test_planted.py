"""The harness's power, measured (issue H): every planted bug of tests/planted.py fails a plain
replay of the golden set with the defaults (both views), with the stage where it was born named;
every benign variant passes."""
from __future__ import annotations

from pathlib import Path

import pytest

import planted
from harness.capture import discover, load_set
from harness.replay import replay

pytestmark = [pytest.mark.cpu, pytest.mark.slow]
GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "set"


@pytest.fixture(scope="module")
def sets():
    return {p: load_set(p) for p in discover(GOLDEN)}


def _relevant(sets, m) -> list[Path]:
    """The golden sets that can show the bug (its launch, the world or data it needs)."""
    k2 = m.born is not None and m.born[0] == "k2"
    out = []
    for p, cs in sets.items():
        if (k2 and not cs.has_k2) or (not k2 and m.born is not None and not cs.has_k1):
            continue
        if m.needs.get("world") and cs.world != m.needs["world"]:
            continue
        out.append(p)
    return out


def _run(paths, m, monkeypatch):
    import sys
    import types

    mod = types.ModuleType(f"planted_{m.name}")
    mod.B = m
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return replay(paths, f"{mod.__name__}:B", "cpu", progress=False)


@pytest.mark.parametrize("m", planted.bugs(), ids=lambda m: m.name)
def test_bug_is_caught_and_blamed(sets, m, monkeypatch):
    paths = _relevant(sets, m)
    assert paths, f"no golden set can show {m.name}: the golden set lost coverage ({m.needs})"
    run = _run(paths, m, monkeypatch)
    failing = [c for c in run.captures if not c.passed]
    assert failing, f"{m.name} ({m.doc}) passed every set"
    born = {(c.born_at.stage, c.born_at.output) for c in failing if c.born_at is not None}
    assert born == {m.born}, f"{m.name}: born at {born}, expected {m.born}"
    assert all(c.born_at is not None for c in failing), [c.errors for c in failing]


@pytest.mark.parametrize("m", planted.benign(), ids=lambda m: m.name)
def test_benign_variant_passes(sets, m, monkeypatch):
    run = _run(list(sets), m, monkeypatch)
    bad = {c.id: c.born_at and (c.born_at.stage, c.born_at.output, c.born_at.view) for c in run.captures
           if not c.passed}
    assert run.passed, f"{m.name} ({m.doc}) failed: {bad}"
