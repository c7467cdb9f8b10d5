"""Stand-in of vLLM's mono runner state (`mono/runner.py`@e2e886c3): one scratch buffer, the
device epoch (bumped once a forward by `step_begin`), the TP group's peer buffer, and the
arguments every launch takes. The real runner keeps them per process; a simulated rank is a
thread, so the stand-in keeps them per thread."""
from __future__ import annotations

import threading

import torch

MAX_TOKENS = 8
_local = threading.local()


def alloc_scratch(device) -> None:
    """At model init: the largest build's scratch (zeroed once) and the epoch."""
    if getattr(_local, "scratch", None) is not None:
        return
    from vllm.models.kimi_k3.amd.mono import layer as k2
    from vllm.models.kimi_k3.amd.mono.attention import kda

    n = max(kda.scratch_bytes(kda.KdaPreBuild(tokens=MAX_TOKENS, qlen=MAX_TOKENS, nblocks=8, delta=True,
                                              state_len=3 + MAX_TOKENS)),
            k2.scratch_bytes(k2.K2Build(tokens=MAX_TOKENS, nblocks=8)))
    _local.scratch = torch.zeros((n + 255) // 256 * 256, dtype=torch.uint8, device=device)
    _local.epoch = torch.zeros(1, dtype=torch.int32, device=device)


def peers(device):
    """The TP group's peer buffer (collective: every rank builds it at its first MoE layer)."""
    if getattr(_local, "peers", None) is None:
        from vllm.distributed import get_tp_group
        from vllm.models.kimi_k3.amd.mono import layer as k2
        from vllm.models.kimi_k3.amd.mono.common.peer_memory import PeerBuffer

        tp = get_tp_group()
        _local.peers = PeerBuffer(k2.peer_bytes(MAX_TOKENS), tp.cpu_group, tp.rank_in_group, tp.world_size, device)
    return _local.peers


def step_begin() -> None:
    """Once a forward, before its first mono launch."""
    if getattr(_local, "epoch", None) is not None:
        _local.epoch.add_(1)


def launch_args() -> dict:
    return {"scratch": _local.scratch, "epoch": _local.epoch}


def peer_args() -> dict:
    from vllm.distributed import get_tp_group

    return {"peers": _local.peers.addresses, "rank": get_tp_group().rank_in_group}


def reset() -> None:
    """Forget this thread's state (a new simulated worker)."""
    p = getattr(_local, "peers", None)
    if p is not None:
        p.close()
    _local.__dict__.clear()
