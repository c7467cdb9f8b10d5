"""Causal short conv over q|k|v with speculative conv state (DESIGN §5 K1.5)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._num import Num


def short_conv(x: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, st_idx: torch.Tensor,
               num_acc: torch.Tensor, qlen: int, num: Num) -> torch.Tensor:
    """x [S, C] (in_proj q|k|v), conv_w [C, W], conv_state [slots, C, SL] (any strides, in place)
    -> silu(conv) [S, C], rounded once.

    Request r reads the window at offset num_acc[r]-1 of slot st_idx[r, 0] (null ≤ 0 reads
    slot 0); a real slot then keeps seq[1:] in positions [0, W-2+L), the rest untouched.
    """
    S, C = x.shape
    W = conv_w.shape[1]
    L = qlen
    R = S // L
    sc = st_idx[:, 0].long()
    read = sc.clamp(min=0)
    off = (num_acc.long() - 1)
    pos = (off[:, None] + torch.arange(W - 1, device=x.device)[None, :])[:, None, :].expand(R, C, W - 1)
    win = conv_state[read].gather(2, pos)  # [R, C, W-1]
    new = x.reshape(R, L, C).transpose(1, 2)  # [R, C, L]
    seq = torch.cat([win, new.to(win.dtype)], dim=-1)  # [R, C, W-1+L], exact (bf16 values)
    # y_j = Σ_q w[c, q]·seq[j+q]
    sf = num.f(seq)
    wf = num.f(conv_w)  # bf16 or vLLM's fp32 weight, read exactly: fp32 products and sum, one bf16 rounding after silu
    y = torch.stack([num.sum(sf[:, :, j:j + W] * wf) for j in range(L)], dim=-1)  # [R, C, L]
    out = num.bf(F.silu(y)).transpose(1, 2).reshape(S, C)
    keep = W - 2 + L
    for r in torch.nonzero(sc > 0).flatten().tolist():
        conv_state[sc[r], :, :keep] = seq[r, :, 1:].to(conv_state.dtype)
    return out
