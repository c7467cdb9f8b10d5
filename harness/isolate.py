"""Isolated view: each reference stage fed the backend's previous tap (DESIGN §9).

Compared with the backend's own tap, the result says where an error is *born*: a
stage whose isolated error is small but whose chained error is large only inherits.
Each function returns the reference's version of every tap it can rebuild from the
backend's taps; a tap the backend does not expose leaves its consumers out.
"""
from __future__ import annotations

import torch

from ref._num import Num
from ref.attnres import attnres, sources
from ref.comm import ordered_sum
from ref.conv import short_conv
from ref.gate import gates
from ref.in_proj import in_proj, split
from ref.kda import kda_recurrence
from ref.latent_tail import latent_norm, up_proj
from ref.norms import gated_rmsnorm, rmsnorm
from ref.router import router_logits, select
from ref.routed_experts import routed_experts
from ref.shared_expert import shared_expert


def k1_isolated(key, args: dict, bt: dict) -> dict:
    """args: one rank's K1 inputs *before* the launch; bt: the backend's K1 taps."""
    num = Num("exact")
    nh, hd, rk = args["a_log"].shape[0], args["on_w"].shape[0], args["w_fb"].shape[1]
    out = {}
    if "x" in bt:
        out["proj"] = in_proj(bt["x"], args["w_in"], num)
    if "proj" in bt:
        parts = split(bt["proj"], nh, hd, rk)
        out["conv_out"] = short_conv(parts["qkv"], args["conv_w"], args["conv_state"].clone(), args["st_idx"],
                                     args["num_acc"], key.qlen, num)
        out["gate"], out["beta"] = gates(parts["fa"], parts["b"], args["w_fb"], args["a_log"], args["dt_bias"],
                                         key.lower_bound, num)
    if all(t in bt for t in ("conv_out", "gate", "beta")):
        P = nh * hd
        q, k, v = (bt["conv_out"][:, i * P:(i + 1) * P].reshape(-1, nh, hd) for i in range(3))
        out["o"] = kda_recurrence(q, k, v, bt["gate"].float(), bt["beta"].float(), args["rstate"].clone(),
                                  args["st_idx"], args["num_acc"], key.qlen, num)
    if "o" in bt and "proj" in bt:
        g2 = split(bt["proj"], nh, hd, rk)["g2"].reshape(-1, nh, hd)
        out["core_out"] = gated_rmsnorm(bt["o"], g2, args["on_w"], key.onorm_eps, num)
    return out


def k2_isolated(key, ranks: list[dict], bts: list[dict]) -> list[dict]:
    """ranks: every rank's K2 inputs before the launch; bts: the backend's K2 taps per rank."""
    num = Num("exact")
    world = len(ranks)
    outs: list[dict] = [{} for _ in ranks]
    have = lambda t: all(t in b for b in bts)  # noqa: E731
    beta, lam = key.situ_beta, key.situ_linear_beta
    for r, (a, bt, o) in enumerate(zip(ranks, bts, outs)):
        if "delta" in bt:
            d = bt["delta"]
            prefix = d if key.reset else num.bf(num.f(a["prefix"]) + num.f(d))
            mixed = attnres(sources(a["blocks"], key.nblocks, prefix), a["ares_nw"], a["ares_qk"], key.eps, num)
            o["x"] = rmsnorm(mixed, a["in_nw"], key.out_eps, num)
        if "x" in bt:
            x = bt["x"]
            o["logits"] = router_logits(x, a["w_gate"], num)
            o["lat"] = num.bf(num.mm(x, a["w_ld"]))
            o["sh"] = shared_expert(x, a["w_sgu"], a["w_sd"], beta, lam, num)
        if "logits" in bt:
            o["topk_ids"], o["topk_w"] = select(bt["logits"].float(), a["bias"], key.topk)
        if "lat" in bt and "topk_ids" in bt and "topk_w" in bt:
            o["y"] = routed_experts(bt["lat"], bt["topk_ids"], bt["topk_w"].float(), a["w13"], a["w13s"],
                                    a["w2"], a["w2s"], key.experts, beta, lam, num)
    if have("y"):
        ls = num.bf(ordered_sum([b["y"] for b in bts]))
        for a, o in zip(ranks, outs):
            o["ln"] = latent_norm(ls, a["ln_w"], key.ln_eps, num)
    for r, (a, bt, o) in enumerate(zip(ranks, bts, outs)):
        if "sh" in bt and "ln" in bt:
            o["fin"] = up_proj(bt["sh"], bt["ln"], a["w_up"], r, num)
    if have("fin") and world:
        total = num.bf(ordered_sum([b["fin"] for b in bts]))
        for o in outs:
            o["out"] = total
    return outs


def clone_args(args: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
