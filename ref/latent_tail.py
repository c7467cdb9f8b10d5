"""Latent all-reduce + norm, row-sharded up projection, final reduce (DESIGN §5 K2.8-10)."""
from __future__ import annotations

import torch

from ._num import Num
from .norms import rmsnorm


def latent_norm(ls: torch.Tensor, ln_w: torch.Tensor, eps: float, num: Num) -> torch.Tensor:
    """Ls [S, LAT] (reduced, rounded) -> LN [S, LAT], rounded once."""
    return rmsnorm(ls, ln_w, eps, num)


def up_proj(sh: torch.Tensor, ln: torch.Tensor, w_up: torch.Tensor, rank: int, num: Num) -> torch.Tensor:
    """sh [S, H], LN [S, LAT], w_up [UP_N, LAT] -> fin [S, H]: sh elsewhere, and
    bf(sh + LN @ w_up^T) on this rank's columns [rank·UP_N, (rank+1)·UP_N) (one rounding)."""
    n = w_up.shape[0]
    fin = sh.clone()
    cols = slice(rank * n, (rank + 1) * n)
    fin[:, cols] = num.bf(num.f(sh[:, cols]) + num.mm(ln, w_up))
    return fin
