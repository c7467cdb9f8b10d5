"""K2's collective: every reduction is an fp32 sum in rank order (DESIGN §5 K2).

Two implementations of one interface, `all_reduce(x, rank) -> fp32 sum`:

- `SimWorld`: all ranks in one process, one thread per rank, meeting at a barrier;
- `DistComm`: torch.distributed (gloo on CPU, NCCL/RCCL on GPUs). It all-gathers and
  sums locally in rank order, so it is bit-identical to `SimWorld` whatever the
  library's own reduction order would be.

`order` (a permutation of ranks) changes the summation order: the reference's
`perturb` mode uses it to measure its own spread.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import torch


def ordered_sum(parts: Sequence[torch.Tensor], order: Sequence[int] | None = None) -> torch.Tensor:
    """Sum in the given rank order; fp32 for bf16/fp32 inputs, f64 stays f64."""
    order = range(len(parts)) if order is None else order
    acc_dtype = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    acc = None
    for r in order:
        p = parts[r].to(acc_dtype)
        acc = p.clone() if acc is None else acc + p
    return acc


def rank_order(world: int, order: Sequence[int] | None = None) -> list[int]:
    """The order an in-process world sums its ranks in (default 0..world-1); ValueError if bad."""
    if world not in (1, 2, 4, 8):
        raise ValueError(f"world: {world} not in 1, 2, 4, 8")
    order = list(order) if order is not None else list(range(world))
    if sorted(order) != list(range(world)):
        raise ValueError(f"order: {order} is not a permutation of 0..{world - 1}")
    return order


class SimWorld:
    """In-process world of `world` ranks; each rank calls from its own thread."""

    def __init__(self, world: int, order: Sequence[int] | None = None, timeout: float = 600.0):
        self.world, self.order = world, rank_order(world, order)
        self._slots: list[torch.Tensor | None] = [None] * world
        self._result: torch.Tensor | None = None
        self._bar = threading.Barrier(world, timeout=timeout)
        self.calls = 0

    def all_reduce(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        if self.world == 1:
            self.calls += 1
            return ordered_sum([x])
        self._slots[rank] = x
        if self._bar.wait() == 0:
            self._result = ordered_sum(self._slots, self.order)
            self.calls += 1
        self._bar.wait()
        out = self._result.clone()
        self._bar.wait()  # nobody may overwrite a slot before all have read the result
        return out

    def abort(self) -> None:
        self._bar.abort()


class DistComm:
    """torch.distributed process group; rank-order sum of an all-gather."""

    def __init__(self, group=None, order: Sequence[int] | None = None):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.world = dist.get_world_size(group)
        self.order = list(order) if order is not None else list(range(self.world))
        self.calls = 0

    def all_reduce(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self.dist.all_gather(parts, x, group=self.group)
        self.calls += 1
        return ordered_sum(parts, self.order)


def run_world(world: int, fn: Callable[[int], object], comm=None, timeout: float | None = None) -> list:
    """Run fn(rank) for every rank in its own (daemon) thread; re-raise the first failure
    (after breaking `comm`'s barrier so the other ranks do not wait for it). With `timeout`
    (seconds for the whole world) a rank still running then is abandoned: `comm` is aborted and
    TimeoutError names it."""
    if world == 1:
        return [fn(0)]
    results: list = [None] * world
    errors: list[BaseException | None] = [None] * world

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e
            if comm is not None and hasattr(comm, "abort"):
                comm.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"k3rank{r}", daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        if comm is not None and hasattr(comm, "abort"):
            comm.abort()
        raise TimeoutError(f"rank(s) {hung} of {world} did not finish within {timeout:g} s")
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
