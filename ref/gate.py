"""KDA gates: per-channel log decay from the f_a/f_b low-rank path, and beta (DESIGN §5 K1.6)."""
from __future__ import annotations

import torch

from ._num import Num


def gates(fa: torch.Tensor, b: torch.Tensor, w_fb: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
          lower_bound: float, num: Num) -> tuple[torch.Tensor, torch.Tensor]:
    """fa [S, RANK] bf16, b [S, NH], w_fb [P, RANK], a_log [NH], dt_bias [P]
    -> gate [S, NH, HD] (log decay, compute dtype), beta [S, NH].

    g1 = bf(fa @ w_fb^T) is the one rounding point; the rest stays in fp32.
    """
    nh = a_log.shape[0]
    S, P = fa.shape[0], w_fb.shape[0]
    hd = P // nh
    g1 = num.bf(num.mm(fa, w_fb)).reshape(S, nh, hd)
    arg = torch.exp(num.f(a_log))[None, :, None] * (num.f(g1) + num.f(dt_bias).reshape(1, nh, hd))
    gate = lower_bound * torch.sigmoid(arg)
    beta = torch.sigmoid(num.f(b))
    return gate, beta
