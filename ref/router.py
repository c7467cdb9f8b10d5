"""Router: sigmoid scores plus correction bias, top-k, normalized weights (DESIGN §5 K2.4)."""
from __future__ import annotations

import torch

from ._num import Num


def router_logits(x: torch.Tensor, w_gate: torch.Tensor, num: Num) -> torch.Tensor:
    """x [S, H] bf16, w_gate [E, H] -> logits [S, E] in fp32 (never rounded)."""
    return num.mm(x, w_gate)


def select(logits: torch.Tensor, bias: torch.Tensor, topk: int,
           force_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, E] -> (ids [S, K] int32 key-descending, ties to lower id; weights [S, K]).

    A NaN key ranks below every number; a NaN sigma counts as 0 in the weights.
    `force_ids` replaces the selection (weights recomputed for those ids, in that order).
    """
    sig = torch.sigmoid(logits)
    if force_ids is None:
        key = sig + bias.to(sig.dtype)
        rank_key = torch.where(torch.isnan(key), torch.full_like(key, -torch.inf), key)
        order = torch.sort(rank_key, dim=-1, descending=True, stable=True).indices
        ids = order[:, :topk]
    else:
        ids = force_ids.long()
    s = torch.gather(sig, 1, ids)
    s = torch.where(torch.isnan(s), torch.zeros_like(s), s)
    total = s[:, 0].clone()
    for k in range(1, s.shape[1]):  # summed in pick order
        total = total + s[:, k]
    return ids.to(torch.int32), s / total[:, None]
