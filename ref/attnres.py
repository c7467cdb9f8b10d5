"""Attention Residuals: a softmax-weighted mix of the bank rows and the prefix (DESIGN §5 K1.2)."""
from __future__ import annotations

import torch

from ._num import Num


def sources(blocks: torch.Tensor, nblocks: int, pre: torch.Tensor) -> torch.Tensor:
    """blocks [S, NBMAX, H], pre [S, H] -> v [S, nblocks + 1, H]: bank rows 0..NB-1, prefix last."""
    return torch.cat([blocks[:, :nblocks], pre.unsqueeze(1)], dim=1)


def attnres(v: torch.Tensor, nw: torch.Tensor, qk: torch.Tensor, eps: float, num: Num) -> torch.Tensor:
    """v [S, NS, H] -> mixed [S, H] in the compute dtype (not rounded: it feeds the norm).

    logit_s = (Σ_d v_s·c) · rsqrt(mean(v_s²) + eps), c = nw ⊙ qk folded in fp32.
    """
    v = num.f(v)
    c = num.f(nw) * num.f(qk)
    logit = num.sum(v * c) * torch.rsqrt(num.mean(v * v) + eps)
    p = torch.softmax(logit, dim=-1)
    return num.sum(p.unsqueeze(-1) * v, dim=1)
