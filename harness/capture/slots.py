"""State compaction (DESIGN §8): which cache slots a K1 step carries, reads and writes.

Both caches share one slot-id space (vLLM), so one slot map compacts both: slot 0 (the null
slot) and every positive st_idx[r, j], j < L. Of those, a step *reads* the conv window of
slot max(st_idx[r, 0], 0) and the recurrent state of st_idx[r, num_acc[r]-1] > 0, and
*writes* conv slot st_idx[r, 0] > 0 and, for a live request (its start slot > 0), the
recurrent state of every st_idx[r, j] > 0. A schema-2 capture stores the read slots' content
only; the rest of the compact cache is POISON_FINITE on load (a slot that should be written
and is not keeps the poison, and shows).
"""
from __future__ import annotations

import torch


def slot_map_for(st_idx: torch.Tensor, qlen: int) -> torch.Tensor:
    """[R, SW] int32 -> int64 [n]: 0 (the null slot), then the sorted positive ids of st_idx[:, :L]."""
    ids = st_idx[:, :qlen].reshape(-1).cpu().to(torch.int64)
    ref_ids = torch.unique(ids[ids > 0])
    return torch.cat([torch.zeros(1, dtype=torch.int64), ref_ids])


def compact_cache(cache: torch.Tensor, slot_map: torch.Tensor) -> torch.Tensor:
    """cache [slots, ...] (any strides) -> contiguous [len(slot_map), ...] copy of those slots."""
    return cache.index_select(0, slot_map.to(cache.device)).contiguous()


def remap_st_idx(st_idx: torch.Tensor, slot_map: torch.Tensor) -> torch.Tensor:
    """Original ids -> compact ids. ≤ 0 stays; a positive id the map lacks (columns ≥ L) -> -1."""
    st = st_idx.cpu().to(torch.int64)
    lut = {int(o): c for c, o in enumerate(slot_map.tolist())}
    out = [[v if v <= 0 else lut.get(v, -1) for v in row] for row in st.tolist()]
    return torch.tensor(out, dtype=torch.int32).reshape(st_idx.shape)


def conv_layout_of(conv_state: torch.Tensor) -> str:
    """'csl': [slots, C, SL] with SL innermost; 'slc': a transposed [slots, SL, C] buffer."""
    return "slc" if conv_state.stride(1) == 1 and conv_state.stride(2) != 1 else "csl"


def step_slots(st_idx: torch.Tensor, num_acc: torch.Tensor, qlen: int) -> dict[str, list[int]]:
    """Original slot ids a K1 step reads and writes, each list sorted:
    conv_read, rstate_read, conv_written, rstate_written (see the module docstring)."""
    L = qlen
    idx = st_idx[:, :L].cpu().to(torch.int64).tolist()
    na = num_acc.cpu().tolist()
    # a num_acc outside 1..L reads nothing here; the loader refuses it (validate.check_indices)
    live = [1 <= a <= L and row[a - 1] > 0 for row, a in zip(idx, na)]
    return {"conv_read": sorted({max(row[0], 0) for row in idx}),
            "rstate_read": sorted({row[a - 1] for row, a, ok in zip(idx, na, live) if ok}),
            "conv_written": sorted({row[0] for row in idx if row[0] > 0}),
            "rstate_written": sorted({v for row, ok in zip(idx, live) if ok for v in row if v > 0})}


def positions(slot_map: list[int], ids: list[int]) -> list[int]:
    """Compact indices of original slot ids (every id must be in the map)."""
    pos = {o: c for c, o in enumerate(slot_map)}
    return [pos[i] for i in ids]


def expand_slots(stored: torch.Tensor, n: int, at: list[int], base: torch.Tensor | None = None) -> torch.Tensor:
    """A compact cache of n slots: `stored` [len(at), ...] placed at compact slots `at`, every
    other slot from `base` (a copy) or POISON_FINITE."""
    from .format import poison_

    if base is not None:
        out = base.clone()
    else:
        out = poison_(torch.empty((n,) + tuple(stored.shape[1:]), dtype=stored.dtype), finite=True)
    if at:
        out[torch.tensor(at, dtype=torch.int64)] = stored
    return out


def expand_rows(stored: torch.Tensor, rows: int) -> torch.Tensor:
    """A bank [S, rows, H] from its stored leading rows [S, n, H], the rest POISON_FINITE."""
    from .format import poison_

    n = stored.shape[1]
    if n == rows:
        return stored.clone()
    out = poison_(torch.empty(stored.shape[0], rows, stored.shape[2], dtype=stored.dtype), finite=True)
    out[:, :n] = stored
    return out


__all__ = ["slot_map_for", "compact_cache", "remap_st_idx", "conv_layout_of", "step_slots", "positions",
           "expand_slots", "expand_rows"]
