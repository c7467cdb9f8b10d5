"""Shared set-up of the Triton interpret tier: TRITON_INTERPRET=1 where there is no GPU
(set before triton is first imported), and the backend/tune fixtures."""
import os

import pytest

from harness.pytest_plugin import gpu_ids

if not gpu_ids():  # no GPU: interpret; on a GPU node the compiled kernels are left compiled
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def backend():
    from fast.triton import BACKEND, _jit

    if not _jit.INTERP:
        pytest.skip("interpret tier: fast.triton is compiled here (a GPU is present, or TRITON_INTERPRET was unset "
                    "at import); the GPU replays through `pytest --backend triton --captures DIR` cover it")
    return BACKEND


@pytest.fixture
def tune():
    """TUNE of the backend with no tuning.ROWS overrides, both restored after the test."""
    from fast.triton import _host
    from fast.triton.tuning import TUNE

    class Checked(dict):
        def update(self, *a, **kw):  # a misspelt knob would silently test the defaults
            new = dict(*a, **kw)
            unknown = set(new) - set(TUNE)
            assert not unknown, f"unknown TUNE keys {sorted(unknown)}"
            TUNE.update(new)

    from fast.triton.tuning import ROWS

    saved, saved_rows = dict(TUNE), {m: dict(o) for m, o in ROWS.items()}
    ROWS.clear()  # what the test sets in TUNE is what every build launches with
    yield Checked()
    TUNE.clear()
    TUNE.update(saved)
    ROWS.clear()
    ROWS.update(saved_rows)
    _host.clear_scratch()
