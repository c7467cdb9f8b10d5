"""Stand-in of `vllm.distributed`'s TP-group queries. vLLM keeps them per process; the
simulated world runs one TP rank per thread, so the stand-in keeps them per thread
(`set_worker`), and a torch.distributed process falls back to its process group."""
from __future__ import annotations

import threading
from types import SimpleNamespace

_local = threading.local()


def set_worker(rank: int, world: int, group=None) -> None:
    """This thread is TP rank `rank` of `world`; `group` is what the peer buffer's handle
    exchange runs over (a SimWorld in threads, a torch.distributed group across processes)."""
    _local.tp = SimpleNamespace(rank_in_group=rank, world_size=world, cpu_group=group)


def get_tp_group():
    tp = getattr(_local, "tp", None)
    if tp is None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("stand-in vllm.distributed: no TP group (call set_worker first)")
        return SimpleNamespace(rank_in_group=dist.get_rank(), world_size=dist.get_world_size(), cpu_group=None)
    return tp


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size
