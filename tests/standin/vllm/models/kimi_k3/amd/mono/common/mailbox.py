"""The stand-in kernels' model of vLLM's mailboxes (`mono/common/sync.py`, `step_tag` of
`mono/attention/kda.py`): a launch's tag is ``(epoch % 2^22)·256 + slot + 1`` and nothing is
zeroed between steps, so a tag used twice on one scratch buffer would let the second launch
read the first one's pairs. The real kernel cannot tell; the stand-in refuses."""
from __future__ import annotations

import weakref

import torch

TAG_SLOTS = 256
_USED: dict[int, tuple] = {}  # scratch.data_ptr() -> (weakref to that scratch tensor, tags claimed)


def claim(scratch: torch.Tensor, need: int, epoch: torch.Tensor, slot: int) -> int:
    if scratch.numel() * scratch.element_size() < need:
        raise RuntimeError(f"scratch of {scratch.numel() * scratch.element_size()} bytes < scratch_bytes {need}")
    if not 0 <= slot < TAG_SLOTS:
        raise RuntimeError(f"layer slot {slot} outside 0..{TAG_SLOTS - 1}")
    if epoch.dtype != torch.int32:
        raise RuntimeError(f"epoch must be a device int32 counter, got {epoch.dtype}")
    e = int(epoch.reshape(-1)[0])
    tag = (e % (1 << 22)) * TAG_SLOTS + slot + 1
    ref, used = _USED.get(scratch.data_ptr(), (None, None))
    if ref is None or ref() is not scratch:  # a new buffer at a freed one's address starts clean
        used = set()
        _USED[scratch.data_ptr()] = (weakref.ref(scratch), used)
    if tag in used:
        raise RuntimeError(f"mailbox tag {tag} (epoch {e}, slot {slot}) used twice on one scratch: the real "
                           "kernel would read the earlier launch's mailboxes")
    used.add(tag)
    return tag


def pair_layout(pairs) -> dict:
    """name -> (byte offset, bytes) of (value, tag) word pairs, regions 16-byte aligned."""
    lay, at = {}, 0
    for name, n in pairs:
        lay[name] = (at, n * 8)
        at = (at + n * 8 + 15) // 16 * 16
    return lay
