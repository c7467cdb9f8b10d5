"""Routed experts, intermediate-sharded, per expert format (DESIGN §5 K2.7, §7)."""
from __future__ import annotations

import torch

from ._num import Num
from .quant import dequant_experts, mx8_fake_quant, mx_fake_quant
from .shared_expert import situ


def routed_experts(lat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13, w13s, w2, w2s, fmt: str,
                   beta: float, lam: float, num: Num) -> torch.Tensor:
    """lat [S, LAT] bf16, ids/weights [S, K], w13 [E, 2RI, ·], w2 [E, LAT, ·] -> y [S, LAT].

    Per pick: gemm1 -> SiTU -> gemm2 in fp32; mxfp4 quantizes lat and v per 32 to MXFP4,
    a8w4 to MXFP8 (E4M3), neither rounds v to bf16; int4/bf16 round v to bf16;
    contrib = bf(acc·w); y = bf(y + contrib) in pick order.
    Each pick's expert is dequantized once, in pick order (exact, elementwise): the memory is
    set by S·K, not by how many distinct experts a step picks.
    """
    S, K = ids.shape
    pick = ids.reshape(-1).long()
    W13 = dequant_experts(w13[pick], None if w13s is None else w13s[pick], fmt, num.dtype)  # [S·K, 2RI, LAT]
    W2 = dequant_experts(w2[pick], None if w2s is None else w2s[pick], fmt, num.dtype)  # [S·K, LAT, RI]
    ri = W13.shape[1] // 2
    act_quant = {"mxfp4": mx_fake_quant, "a8w4": mx8_fake_quant}.get(fmt)
    a = num.f(lat)
    if act_quant is not None:
        a = act_quant(a)
    # every pick's GEMMs at once (each pick is independent); picks in [S, K] order
    gu = torch.einsum("sl,sknl->skn", a, W13.reshape(S, K, 2 * ri, -1))
    v = situ(gu[..., :ri], gu[..., ri:], beta, lam)
    v = act_quant(v) if act_quant is not None else num.f(num.bf(v))
    acc = torch.einsum("skr,sklr->skl", v, W2.reshape(S, K, W2.shape[1], ri))
    contrib = num.f(num.bf(acc * num.f(weights)[..., None]))  # [S, K, LAT]
    y = torch.zeros(S, lat.shape[1], dtype=num.dtype, device=lat.device)
    for k in range(K):  # the pick order is the contract (perturb leaves it): one rounding per add
        y = num.f(num.bf(y + contrib[:, k]))
    return num.bf(y)
