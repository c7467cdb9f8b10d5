"""A fast content digest of tensors, computed where they live and identical on CPU, CUDA
and ROCm: integer arithmetic only, and a sum, so neither the device nor the reduction
order can change it.

Each 32-bit word w_i of the tensor's bytes (zero-padded to whole words) is mixed with its
index by a 32-bit avalanche hash, under four salts; the digest is the four sums of the
mixed words, each below 2^64 (a sum of < 2^31 values < 2^32 never overflows int64). It
detects any changed, moved or swapped word with overwhelming odds; it is not a
cryptographic hash (sha256 stays what names files).
"""
from __future__ import annotations

import os

import torch

ALGO = "k3mix32x4"
_M = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2^27: a product with a 32-bit value stays below 2^63
_SALTS = (0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F)
_CHUNK = 1 << 24  # words per pass: bounds the temporaries (~0.5 GiB of int64 at most)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = ((x ^ (x >> 16)) * _MUL) & _M
    x = ((x ^ (x >> 16)) * _MUL) & _M
    return x ^ (x >> 16)


def words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (row-major) as int64 words 0..2^32-1, little-endian, zero-padded."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    w = b.view(-1, 4).to(torch.int64)
    return w[:, 0] | (w[:, 1] << 8) | (w[:, 2] << 16) | (w[:, 3] << 24)


def _sums_torch(b: torch.Tensor, idx0: int) -> list[int]:
    """The four sums over the words of bytes `b` whose first global word index is idx0."""
    w = words(b)
    idx = torch.arange(idx0, idx0 + w.numel(), device=w.device, dtype=torch.int64) & _M
    return [int(_mix(w ^ _mix(idx ^ salt)).sum()) for salt in _SALTS]


def _kernel():
    """harness._digest_kernel.word_sums, or None where Triton cannot run (K3_DIGEST=torch forces None)."""
    if os.environ.get("K3_DIGEST", "auto") == "torch":
        return None
    try:
        from ._digest_kernel import word_sums
    except ImportError:
        return None
    return word_sums


def digest(t: torch.Tensor, kernel=None) -> str:
    """`ALGO:` + 64 hex digits; dtype and shape are not part of it (record them beside).

    On a GPU the whole words go through one Triton launch per chunk (`kernel`, found by
    default); elsewhere, and for a trailing partial word, through torch."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = b.numel()
    if kernel is None and b.is_cuda:
        kernel = _kernel()
    sums = [0, 0, 0, 0]
    step = 4 * _CHUNK
    for lo in range(0, n, step):
        chunk = b[lo:lo + step]
        whole = chunk.numel() // 4 * 4 if kernel is not None else 0
        parts = []
        if whole:
            w32 = chunk[:whole] if chunk.storage_offset() % 4 == 0 else chunk[:whole].clone()
            parts.append(kernel(w32.view(torch.int32), lo // 4))
        if whole < chunk.numel():
            parts.append(_sums_torch(chunk[whole:], (lo + whole) // 4))
        for p in parts:
            sums = [s + v for s, v in zip(sums, p)]
    return ALGO + ":" + "".join(f"{s % (1 << 64):016x}" for s in sums)


def digest_all(tensors: dict) -> dict[str, str]:
    """{name: digest} of every tensor of a dict (None values skipped)."""
    return {n: digest(t) for n, t in sorted(tensors.items()) if t is not None}
