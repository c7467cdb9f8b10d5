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


def digest(t: torch.Tensor) -> str:
    """`ALGO:` + 64 hex digits; dtype and shape are not part of it (record them beside)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = b.numel()
    sums = [0, 0, 0, 0]
    step = 4 * _CHUNK
    for lo in range(0, max(n, 1), step):
        w = words(b[lo:lo + step])
        if w.numel() == 0:
            break
        idx = torch.arange(lo // 4, lo // 4 + w.numel(), device=w.device, dtype=torch.int64) & _M
        for k, salt in enumerate(_SALTS):
            sums[k] += int(_mix(w ^ _mix(idx ^ salt)).sum())
    return ALGO + ":" + "".join(f"{s % (1 << 64):016x}" for s in sums)


def digest_all(tensors: dict) -> dict[str, str]:
    """{name: digest} of every tensor of a dict (None values skipped)."""
    return {n: digest(t) for n, t in sorted(tensors.items()) if t is not None}
