"""KDA recurrence over the L speculative tokens of each request (DESIGN §5 K1.7)."""
from __future__ import annotations

import torch

from ._num import Num
from .norms import l2norm

L2_EPS = 1e-6


def kda_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, beta: torch.Tensor,
                   rstate: torch.Tensor, st_idx: torch.Tensor, num_acc: torch.Tensor, qlen: int,
                   num: Num) -> torch.Tensor:
    """q, k, v [S, NH, HD] (bf16 conv outputs), gate [S, NH, HD] (log decay), beta [S, NH],
    rstate [slots, NH, HD(v), HD(k)] (in place) -> o [S, NH, HD], rounded once per token.

    Starts from slot st_idx[r, num_acc[r]-1] (≤ 0: padding, o = 0, nothing written) and
    writes the state after token j to st_idx[r, j] when > 0. All reads precede writes.
    """
    S, NH, HD = q.shape
    L = qlen
    R = S // L
    shp = (R, L, NH, HD)
    qn = l2norm(num.f(q), L2_EPS, num).reshape(shp) * HD ** -0.5
    kn = l2norm(num.f(k), L2_EPS, num).reshape(shp)
    vf = num.f(v).reshape(shp)
    decay = torch.exp(gate).reshape(shp)
    bt = beta.reshape(R, L, NH)
    ar = torch.arange(R, device=q.device)
    s0 = st_idx[ar, num_acc.long() - 1].long()
    live = s0 > 0
    state = num.f(rstate[s0.clamp(min=0)]).clone()  # [R, NH, V, K]; padding rows are ignored
    o = torch.zeros(R, L, NH, HD, dtype=num.dtype, device=q.device)
    writes = []
    for j in range(L):
        state = state * decay[:, j, :, None, :]
        pred = num.sum(state * kn[:, j, :, None, :])  # S·k  [R, NH, V]
        u = (vf[:, j] - pred) * bt[:, j, :, None]
        state = state + u[..., :, None] * kn[:, j, :, None, :]
        o[:, j] = num.f(num.bf(num.sum(state * qn[:, j, :, None, :])))
        writes.append(state.clone())
    o[~live] = 0
    for j in range(L):
        slot = st_idx[:, j].long()
        ok = live & (slot > 0)
        if bool(ok.any()):
            rstate[slot[ok]] = writes[j][ok].to(rstate.dtype)
    return num.bf(o.reshape(S, NH, HD))
