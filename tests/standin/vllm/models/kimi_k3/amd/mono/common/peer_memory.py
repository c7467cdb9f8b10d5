"""Stand-in of `mono/common/peer_memory.py`. The real PeerBuffer maps every rank's uncached
buffer over HIP IPC and the kernel reduces over it; here the buffer's address table stands
for the group, and the kernel stand-in reduces through that group's collective (a SimWorld
in threads, torch.distributed across processes), in rank order as the real kernel does."""
from __future__ import annotations

import torch

_GROUPS: dict[int, object] = {}  # addresses.data_ptr() -> collective


class PeerBuffer:
    def __init__(self, nbytes: int, group, rank: int, npes: int, device):
        from ref.comm import DistComm

        self.comm = group if hasattr(group, "all_reduce") else DistComm(group)
        if self.comm.world != npes:
            raise RuntimeError(f"peer buffer of {npes} ranks over a group of {self.comm.world}")
        self.bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.rank = rank
        self.addresses = torch.arange(npes, dtype=torch.int64, device=device)
        _GROUPS[self.addresses.data_ptr()] = self.comm

    def kernel_args(self) -> dict:
        return {"sym": self.bytes.data_ptr(), "peers": self.addresses.data_ptr(), "rank": self.rank}

    def close(self) -> None:
        _GROUPS.pop(self.addresses.data_ptr(), None)


def group_of(peers: torch.Tensor):
    """The collective behind a peer address table (the kernel stand-in's view of `peers`)."""
    try:
        return _GROUPS[peers.data_ptr()]
    except KeyError:
        raise RuntimeError("peers: not the address table of a live PeerBuffer") from None
