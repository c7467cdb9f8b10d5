"""K2's collective for the Triton twin when every rank lives on one device: each reduction
is one launch over a stacked [world, ...] buffer, summed in rank order in fp32, bit for bit
what ref.comm.ordered_sum (SimWorld, DistComm) returns.

- `rank_sum(stack, order, out)`: out = Σ_r stack[order[r]] in fp32, left to right from the
  first rank's value (no 0 + first: a -0 stays -0, as in ordered_sum).
- `DeviceWorld(world, order=None)`: the ref.comm interface (`world`, `all_reduce(x, rank)`,
  `abort()`), ranks in threads as with SimWorld; every rank copies its partial into its slot
  of the stack, the last to arrive launches the sum, every rank gets the same fp32 result.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch
import triton
import triton.language as tl

from ref.comm import rank_order

from ._host import _launch

BLOCK = 1024


@triton.jit
def rank_sum_kernel(stack_ptr, order_ptr, out_ptr, N, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (cdiv(N, BLOCK),): out[n] = ((s[o0][n] + s[o1][n]) + s[o2][n]) + ... in fp32.
    stack [WORLD, N] (bf16 or fp32), order [WORLD] int32 (a permutation of the ranks)."""
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = rn < N
    acc = tl.load(stack_ptr + tl.load(order_ptr).to(tl.int64) * N + rn, mask=m, other=0.0).to(tl.float32)
    for r in tl.static_range(1, WORLD):
        acc += tl.load(stack_ptr + tl.load(order_ptr + r).to(tl.int64) * N + rn, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, acc, mask=m)


def rank_sum(stack: torch.Tensor, order: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """stack [world, ...] contiguous, order [world] int32 on the same device, out [...] fp32."""
    w = stack.shape[0]
    n = stack[0].numel()
    if not stack.is_contiguous() or out.numel() != n or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("rank_sum: stack must be contiguous [world, ...], out fp32 contiguous of one slot's size")
    _launch(rank_sum_kernel, (triton.cdiv(n, BLOCK),), stack, order, out, n, WORLD=w, BLOCK=BLOCK, num_warps=4)
    return out


class DeviceWorld:
    """In-process world of `world` ranks on one device; each rank calls from its own thread
    (ref.comm.run_world). One stack per (shape, dtype) is reused across calls: the sum of a call
    is enqueued before any rank can enqueue the copies of the next one."""

    def __init__(self, world: int, order: Sequence[int] | None = None, timeout: float = 600.0):
        self.world, self.order = world, rank_order(world, order)
        self._bar = threading.Barrier(world, timeout=timeout)
        self._stacks: dict = {}
        self._orders: dict = {}
        self._result: torch.Tensor | None = None
        self._lock = threading.Lock()
        self.calls = 0

    def _stack(self, x: torch.Tensor) -> torch.Tensor:
        k = (tuple(x.shape), x.dtype, str(x.device))
        with self._lock:
            if k not in self._stacks:
                self._stacks[k] = torch.empty((self.world,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            if str(x.device) not in self._orders:
                self._orders[str(x.device)] = torch.tensor(self.order, dtype=torch.int32, device=x.device)
            return self._stacks[k]

    def all_reduce(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        st = self._stack(x)
        st[rank].copy_(x)
        if self.world > 1 and self._bar.wait() != 0:
            self._bar.wait()  # the sum is enqueued
            return self._result
        self._result = rank_sum(st, self._orders[str(x.device)], torch.empty(x.shape, dtype=torch.float32,
                                                                               device=x.device))
        self.calls += 1
        if self.world > 1:
            self._bar.wait()
        return self._result

    def abort(self) -> None:
        self._bar.abort()


__all__ = ["DeviceWorld", "rank_sum", "rank_sum_kernel"]
