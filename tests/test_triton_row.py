"""Triton backend, interpreted (tiny config): the one-token mxfp4 routed GEMMs by FMA dot
products (TUNE x1_row / x2_row, fast.triton._k2._xrow) against the reference's routed stage
fed the backend's own lat / picks bit for bit, and against the MMA path bit for bit; likewise
the scale codes loaded per block and as one word per step (x1_sload, x1_sw).
"""
from __future__ import annotations

import pytest
import torch

from triton_tier import backend, triton, tune  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import triton.language as tl  # noqa: E402,F401  (visible to the jit function below)

import ref  # noqa: E402
from fast.triton import _jit as fj, _k2  # noqa: E402
from conftest import clone, make_k2  # noqa: E402
from ref._num import Num  # noqa: E402
from ref.routed_experts import routed_experts  # noqa: E402

pytestmark = pytest.mark.interpret


def _run(backend, key, ranks):
    b = [dict(clone(r), taps={}) for r in ranks]
    for x in b:
        x["out"].fill_(float("nan"))
    ref.k2_world(key, b, launch=backend.k2_launch)
    return b


def _isolated(key, w, tb, fmt="mxfp4"):
    return routed_experts(tb["lat"], tb["topk_ids"], tb["topk_w"], w["w13"], w["w13s"], w["w2"], w["w2s"], fmt,
                          key.situ_beta, key.situ_linear_beta, Num())


def _same_bits(backend, tune, key, ranks, fmt, base: dict, variant: dict, what: str):
    """TUNE base then base + variant: y and out bit for bit alike, y equal to the reference's
    routed stage fed the variant's own lat / picks (non-zero, finite)."""
    tune.update(base)
    a = _run(backend, key, ranks)
    tune.update(variant)
    b = _run(backend, key, ranks)
    for r, w in enumerate(ranks):
        tb = b[r]["taps"]
        assert torch.isfinite(tb["y"].float()).all() and tb["y"].abs().max() > 0
        assert torch.equal(tb["y"], _isolated(key, w, tb, fmt)), f"rank {r}: {what} differs from the reference stage"
        assert torch.equal(tb["y"], a[r]["taps"]["y"]), f"rank {r}: {what} differs from the other path"
        assert torch.equal(b[r]["out"], a[r]["out"])


@pytest.mark.parametrize("layer,tune_set", [
    (1, {}),
    (2, dict(x1_unr=1, x1_split=2, x2_unr=1)),  # gemm1 K split 2, one 32-block per step
])
def test_row_path_bit_exact(backend, tune, seed, layer, tune_set):
    key, ranks = make_k2(seed=seed + layer, fmt="mxfp4", layer=layer, S=1)
    _same_bits(backend, tune, key, ranks, "mxfp4", dict(tune_set, x1_row=False, x2_row=False),
               dict(x1_row=True, x2_row=True), "row path")


@triton.jit
def _pow2_off(e):
    return fj.pow2(e + 1)


def test_planted_scale_bug_fails(backend, tune, seed, monkeypatch):
    """The row path with every activation scale read one binade high must fail both comparisons."""
    key, ranks = make_k2(seed=seed, fmt="mxfp4", layer=1, S=1)
    tune.update(x1_row=False, x2_row=False)
    mma = _run(backend, key, ranks)
    tune.update(x1_row=True, x2_row=True)
    monkeypatch.setattr(_k2, "pow2", _pow2_off)
    row = _run(backend, key, ranks)
    tb = row[0]["taps"]
    assert not torch.equal(tb["y"], _isolated(key, ranks[0], tb))
    assert not torch.equal(tb["y"], mma[0]["taps"]["y"])


@pytest.mark.parametrize("fmt", ["mxfp4", "int4", "a8w4"])
def test_scales_loaded_per_block_same_bits(backend, tune, seed, fmt):
    """TUNE x1_sload / x2_sload (each block's scales loaded where used) against the per-step
    prefetch, several tokens (the MMA path), bit for bit; and y against the isolated stage."""
    key, ranks = make_k2(seed=seed, fmt=fmt, layer=1, S=5)
    _same_bits(backend, tune, key, ranks, fmt, dict(x1_unr=2, x2_unr=2), dict(x1_sload=True, x2_sload=True),
               "per-block scale loads")


@pytest.mark.parametrize("fmt", ["mxfp4", "a8w4"])
def test_scale_words_same_bits(backend, tune, seed, fmt):
    """TUNE x1_sw / x2_sw (a step's scale codes loaded as one word per row) against the codes
    loaded as bytes and packed, several tokens (the MMA path), bit for bit; y against the
    isolated stage."""
    key, ranks = make_k2(seed=seed, fmt=fmt, layer=1, S=5)
    _same_bits(backend, tune, key, ranks, fmt, dict(x1_unr=2, x2_unr=1, x1_sw=False, x2_sw=False),
               dict(x1_sw=True, x2_sw=True), "word scale loads")


@triton.jit
def _words_probe(src, out, UNR: tl.constexpr, N: tl.constexpr):
    r = tl.arange(0, N)
    w = _k2._words(src + r * (2 * UNR), 1, UNR)
    tl.store(out + r, w.to(tl.int64))


@pytest.mark.parametrize("unr", [1, 2, 4, 8])
def test_words_little_endian(backend, unr):
    """_k2._words at every width against the word packed in Python: row r's step-1 codes
    (bytes r·2·UNR + UNR .. + 2·UNR) with code u in byte u, high bits set in every byte."""
    N = 4
    src = torch.randint(128, 256, (N * 2 * unr,), dtype=torch.uint8, generator=torch.Generator().manual_seed(unr))
    out = torch.full((N,), -1, dtype=torch.int64)
    _words_probe[(1,)](src, out, UNR=unr, N=N)
    want = [sum(int(src[r * 2 * unr + unr + u]) << (8 * u) for u in range(unr)) for r in range(N)]
    bits = 64 if unr == 8 else 32
    got = [int(v) % (1 << bits) for v in out]
    assert got == [w % (1 << bits) for w in want]


def test_words_ok_guard():
    """The host takes the word loads only for byte codes, contiguous along K, whose row strides
    and base are multiples of the word: else the per-byte path (same bits, just slower)."""
    from fast.triton._host import _words_ok
    s = torch.zeros(3, 8, 16, dtype=torch.uint8)
    assert _words_ok(s, 4) and _words_ok(s, 8)
    assert not _words_ok(s.transpose(1, 2), 4)  # codes not contiguous along K
    assert not _words_ok(s[:, :, 1:], 2)  # base off the word boundary
    assert not _words_ok(torch.zeros(3, 8, 12, dtype=torch.uint8), 8)  # row stride 12
    assert not _words_ok(torch.zeros(3, 8, 16, dtype=torch.bfloat16), 4)  # int4's bf16 scales
