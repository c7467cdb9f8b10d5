"""in_proj GEMM and its column blocks (DESIGN §5 K1.4)."""
from __future__ import annotations

import torch

from ._num import Num


def in_proj(x: torch.Tensor, w_in: torch.Tensor, num: Num) -> torch.Tensor:
    """x [S, H] bf16, w_in [NPROJ, H] -> proj [S, NPROJ], rounded once after fp32 accumulation."""
    return num.bf(num.mm(x, w_in))


def split(proj: torch.Tensor, nh: int, hd: int, rank: int) -> dict[str, torch.Tensor]:
    """proj [S, NPROJ] -> q k v g2 [S, P], qkv [S, 3P], fa [S, RANK], b [S, NH] (views)."""
    p = nh * hd
    return dict(q=proj[:, :p], k=proj[:, p:2 * p], v=proj[:, 2 * p:3 * p], qkv=proj[:, :3 * p],
                g2=proj[:, 3 * p:4 * p], fa=proj[:, 4 * p:4 * p + rank],
                b=proj[:, 4 * p + rank:4 * p + rank + nh])
