"""SiTU activation and the shared experts (column/row parallel, unreduced) (DESIGN §5 K2.6)."""
from __future__ import annotations

import torch

from ._num import Num


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, lam: float) -> torch.Tensor:
    """β·tanh(g/β)·sigmoid(g) · λ·tanh(u/λ), in the dtype of g and u."""
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (lam * torch.tanh(u / lam))


def shared_expert(x: torch.Tensor, w_sgu: torch.Tensor, w_sd: torch.Tensor, beta: float, lam: float,
                  num: Num) -> torch.Tensor:
    """x [S, H], w_sgu [2SI, H], w_sd [H, SI] -> sh [S, H] (this rank's partial).

    Rounds gu, h and sh once each.
    """
    si = w_sd.shape[1]
    gu = num.f(num.bf(num.mm(x, w_sgu)))
    h = num.bf(situ(gu[:, :si], gu[:, si:], beta, lam))
    return num.bf(num.mm(h, w_sd))
