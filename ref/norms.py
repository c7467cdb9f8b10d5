"""RMSNorms: input / post-attention, latent, gated per-head, and the KDA L2 norm."""
from __future__ import annotations

import torch

from ._num import Num


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, num: Num) -> torch.Tensor:
    """x [..., N] (any float dtype), w [N] -> bf(x·rsqrt(mean(x²)+eps)·w); one rounding at the end."""
    x = num.f(x)
    return num.bf(x * torch.rsqrt(num.mean(x * x, keepdim=True) + eps) * num.f(w))


def gated_rmsnorm(o: torch.Tensor, g2: torch.Tensor, w: torch.Tensor, eps: float, num: Num) -> torch.Tensor:
    """o [S, NH, HD] (bf16 values), g2 [S, NH, HD], w [HD] -> core [S, NH·HD], rounded once."""
    o = num.f(o)
    y = o * torch.rsqrt(num.mean(o * o, keepdim=True) + eps) * num.f(w) * torch.sigmoid(num.f(g2))
    return num.bf(y).flatten(1)


def l2norm(x: torch.Tensor, eps: float, num: Num) -> torch.Tensor:
    """x [..., HD] -> x·rsqrt(Σx² + eps), kept in the compute dtype (never rounded)."""
    return x * torch.rsqrt(num.sum(x * x, keepdim=True) + eps)
