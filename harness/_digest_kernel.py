"""The k3mix32x4 word sums (harness.digest) as one Triton launch per chunk, for tensors on a
GPU: the torch path makes ~60 elementwise int64 passes over every word, this one reads each
word once. Same integers, so the same digest (tests/test_digest_kernel.py, interpreted on a
CPU, compiled on a GPU)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # words per program: a program's sum of < 2^12 values < 2^32 fits int64


@triton.jit
def _mix(x):
    x = (x ^ (x >> 16)) * 0x45D9F3B
    x = (x ^ (x >> 16)) * 0x45D9F3B
    return x ^ (x >> 16)


@triton.jit
def _k3mix_sums(w_ptr, n, idx0, out_ptr, BLOCK: tl.constexpr):
    """Grid (cdiv(n, BLOCK),): out[pid, k] = Σ over the block's words of mix(w ^ mix(idx ^ salt_k)),
    idx the word's global index mod 2^32 (uint32 products wrap mod 2^32, as the torch path masks)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    w = tl.load(w_ptr + offs, mask=live, other=0).to(tl.uint32, bitcast=True)
    idx = (offs + idx0).to(tl.uint32)
    s0 = tl.sum(tl.where(live, _mix(w ^ _mix(idx ^ 0x9E3779B9)), 0).to(tl.int64), axis=0)
    s1 = tl.sum(tl.where(live, _mix(w ^ _mix(idx ^ 0x85EBCA6B)), 0).to(tl.int64), axis=0)
    s2 = tl.sum(tl.where(live, _mix(w ^ _mix(idx ^ 0xC2B2AE35)), 0).to(tl.int64), axis=0)
    s3 = tl.sum(tl.where(live, _mix(w ^ _mix(idx ^ 0x27D4EB2F)), 0).to(tl.int64), axis=0)
    tl.store(out_ptr + pid * 4 + 0, s0)
    tl.store(out_ptr + pid * 4 + 1, s1)
    tl.store(out_ptr + pid * 4 + 2, s2)
    tl.store(out_ptr + pid * 4 + 3, s3)


def word_sums(w32: torch.Tensor, idx0: int) -> list[int]:
    """The four sums over int32 words `w32` (1-D, contiguous) whose first global index is idx0."""
    n = w32.numel()
    nprog = triton.cdiv(n, BLOCK)
    part = torch.empty(nprog, 4, dtype=torch.int64, device=w32.device)
    _k3mix_sums[(nprog,)](w32, n, idx0, part, BLOCK=BLOCK)
    return [int(s) for s in part.sum(0).tolist()]  # < 2^31 words per chunk: no int64 overflow
