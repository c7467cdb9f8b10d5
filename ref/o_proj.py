"""o_proj (row-parallel) and the all-reduce of its partials (DESIGN §5 K2.1)."""
from __future__ import annotations

import torch

from ._num import Num


def o_proj_partial(core: torch.Tensor, w_o: torch.Tensor, num: Num) -> torch.Tensor:
    """core [S, P], w_o [H, P] -> this rank's partial [S, H], rounded once."""
    return num.bf(num.mm(core, w_o))


def reduce_bf(x: torch.Tensor, rank: int, comm, num: Num) -> torch.Tensor:
    """Rank-order sum through the collective (fp32 / f64), rounded once after it."""
    return num.bf(comm.all_reduce(x, rank))
