"""The routed GEMMs' E2M1 nibble decode (fast.triton._k2._nib): the portable form (interpreted
on the CPU or compiled on a GPU) and the inline-PTX form (NVIDIA only) against a table built
here from the E2M1 definition, for every byte value in a tile shaped as the kernels load it."""
from __future__ import annotations

import pytest
import torch

from triton_tier import triton  # noqa: F401  (sets TRITON_INTERPRET first)

import triton.language as tl  # noqa: E402

from fast.triton import _jit as fj  # noqa: E402
from fast.triton._k2 import _nib  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _decode_kernel(b_ptr, lo_ptr, hi_ptr, BR: tl.constexpr, PTX: tl.constexpr):
    off = tl.arange(0, BR)[:, None] * 16 + tl.arange(0, 16)[None, :]
    lo, hi = _nib(tl.load(b_ptr + off), PTX)
    tl.store(lo_ptr + off, lo)
    tl.store(hi_ptr + off, hi)


def _e2m1(code: int) -> float:
    """E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


def _table() -> tuple[torch.Tensor, torch.Tensor]:
    """(low nibble, high nibble) of bytes 0..255 as fp16 holding value·2^-14 (exact)."""
    lo = torch.tensor([_e2m1(b & 0xF) * 2.0 ** -14 for b in range(256)], dtype=torch.float64)
    hi = torch.tensor([_e2m1(b >> 4) * 2.0 ** -14 for b in range(256)], dtype=torch.float64)
    return lo.to(torch.float16), hi.to(torch.float16)


def _check(ptx: bool, br: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    b = torch.cat([torch.arange(256, dtype=torch.uint8), torch.randint(0, 256, (br * 16,), generator=g,
                                                                          dtype=torch.uint8)])[: br * 16]
    b = b[torch.randperm(b.numel(), generator=g)] if seed else b
    lo = torch.empty(br * 16, dtype=torch.float16, device=DEV)
    hi = torch.empty_like(lo)
    _decode_kernel[(1,)](b.to(DEV), lo, hi, BR=br, PTX=ptx)
    tlo, thi = _table()
    idx = b.long()
    # bit for bit: +0 and -0 (codes 0 and 8) differ in the sign bit
    assert torch.equal(lo.cpu().view(torch.int16), tlo[idx].view(torch.int16)), "low nibble plane"
    assert torch.equal(hi.cpu().view(torch.int16), thi[idx].view(torch.int16)), "high nibble plane"


@pytest.mark.interpret
@pytest.mark.parametrize("br,seed", [(16, 0), (64, 1)])
def test_portable_decode_is_e2m1(br, seed):
    _check(False, br, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("br,seed", [(16, 0), (16, 2), (64, 1), (128, 3)])
def test_ptx_decode_is_e2m1(br, seed):
    if fj.INTERP or DEV != "cuda" or torch.version.hip is not None:
        pytest.skip("inline PTX needs an NVIDIA GPU (compiled Triton)")
    _check(True, br, seed)
