"""harness._digest_kernel (the GPU path of harness.digest), interpreted on the CPU or compiled
on a GPU: the same digest as the torch path for every length, offset and chunking, and the
pinned value of the algorithm."""
from __future__ import annotations

import pytest
import torch

from triton_tier import triton  # noqa: F401  (sets TRITON_INTERPRET first)

import harness.digest as dg  # noqa: E402
from harness._digest_kernel import word_sums  # noqa: E402

pytestmark = pytest.mark.interpret
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _both(t):
    return dg.digest(t, kernel=word_sums), dg.digest(t.cpu())  # the second: torch on the CPU


@pytest.mark.parametrize("nbytes", [1, 3, 4, 7, 4096 * 4, 4096 * 4 + 5, 3 * 4096 * 4 + 2])
def test_kernel_equals_torch_path(nbytes, rng):
    x = torch.randint(0, 256, (nbytes,), generator=rng, dtype=torch.uint8).to(DEV)
    k, t = _both(x)
    assert k == t


def test_high_words_offsets_and_chunks(monkeypatch, rng):
    """Words with the top bit set (sign of int32), a view at a byte offset that is not a word
    boundary, and chunk boundaries inside a program block."""
    x = torch.randint(0, 256, (3 * 4096 * 4 + 9,), generator=rng, dtype=torch.uint8)
    x[::4] = 0xFF
    x = x.to(DEV)
    assert _both(x)[0] == _both(x)[1]
    assert _both(x[5:])[0] == _both(x[5:])[1]
    whole = dg.digest(x.cpu())
    monkeypatch.setattr(dg, "_CHUNK", 1000)
    assert dg.digest(x, kernel=word_sums) == whole


def test_known_value():
    """The pinned value of test_digest.py, through the kernel."""
    assert dg.digest(torch.arange(16, dtype=torch.int32).to(DEV), kernel=word_sums) == (
        dg.ALGO + ":00000009fcc3b4e400000008e1fbc415000000076e7e1e3500000006982252af")


def test_a_changed_word_changes_it(rng):
    x = torch.randn(5000, generator=rng).to(DEV)
    y = x.clone()
    y[4099] = torch.nextafter(y[4099], torch.tensor(float("inf"), device=DEV))
    assert dg.digest(x, kernel=word_sums) != dg.digest(y, kernel=word_sums)
