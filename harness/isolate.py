"""Isolated view: each reference stage fed the other side's previous tap (DESIGN §9).

Compared with the backend's own tap, the result says where an error is *born*: a
stage whose isolated error is small but whose chained error is large only inherits.
The reference's own compositions do the work (`ref.kda_pre` / `ref.k2_launch` with
`feed=`), so the dataflow is written once. Only outputs whose every input was fed are
returned (`K1_STAGE_INPUTS` / `K2_STAGE_INPUTS`): a tap the backend does not expose leaves
its consumers out.
"""
from __future__ import annotations

import torch

import ref
from ref.k2_launch import K2_STAGE_INPUTS
from ref.kda_pre import K1_STAGE_INPUTS

K1_WRITTEN = ("core_out", "conv_state", "rstate")  # in-place K1 outputs an isolated run also gives
K2_WRITTEN = ("prefix", "out")
K1_WRITES = ("prefix", "blocks", "conv_state", "rstate", "core_out")  # what a K1 launch writes in place
K2_WRITES = ("prefix", "out")


def clone_args(args: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def clone_state(args: dict, names) -> dict:
    """A launch-arg dict whose `names` are private copies; every other tensor (the weights) is shared."""
    return {k: (v.clone() if k in names and isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def _fed(feed: dict, inputs, world_feeds=None) -> bool:
    return all(n in f for f in (world_feeds or [feed]) for n in inputs)


def k1_feed_run(key, args: dict, feed: dict, **kw) -> tuple[dict, dict]:
    """The reference's K1 of one rank fed `feed`. args: the inputs before the launch (not
    modified). Returns (isolated outputs by tap/output name, the launch args after it)."""
    a = clone_state(args, K1_WRITES)
    taps: dict = {}
    ref.kda_pre(key, **a, taps=taps, feed=feed, **kw)
    out = {}
    for name, inputs in K1_STAGE_INPUTS.items():
        if not _fed(feed, inputs):
            continue
        out[name] = a[name] if name in K1_WRITTEN else taps[name]
    return out, a


def k1_isolated(key, args: dict, bt: dict) -> dict:
    """args: one rank's K1 inputs *before* the launch; bt: the backend's K1 taps -> the
    reference's isolated taps, core_out, and the caches written from fed inputs (conv_state
    from proj, rstate from conv_out/gate/beta)."""
    return k1_feed_run(key, args, bt)[0]


def k2_feed_run(key, ranks: list[dict], feeds: list[dict], **kw) -> tuple[list[dict], list[dict]]:
    """The reference's K2 of every rank fed `feeds` (one per rank). ranks: inputs before the
    launch (not modified). Returns (isolated outputs per rank, launch args after per rank)."""
    args = [clone_state(a, K2_WRITES) for a in ranks]
    taps = [{} for _ in ranks]
    for a, t, f in zip(args, taps, feeds):
        a["taps"], a["feed"] = t, f
    ref.k2_world(key, args, **kw)
    outs = []
    for a, t, f in zip(args, taps, feeds):
        a.pop("taps"), a.pop("feed")
        o = {}
        for name, inputs in K2_STAGE_INPUTS.items():
            # ln and out reduce every rank's y / fin: all ranks must have been fed
            if _fed(f, inputs, feeds if name in ("ln", "out") else None):
                o[name] = a[name] if name in K2_WRITTEN else t[name]
        outs.append(o)
    return outs, args


def k2_isolated(key, ranks: list[dict], bts: list[dict]) -> list[dict]:
    """ranks: every rank's K2 inputs before the launch; bts: the backend's K2 taps per rank."""
    return k2_feed_run(key, ranks, bts)[0]


def delta_ulp_unit(ranks: list[dict], delta: torch.Tensor) -> torch.Tensor:
    """max_ulp's unit for isolated delta = bf(Σ_r bf(core_r @ w_o_r)): each partial of a correct
    kernel may sit one ulp away (its own GEMV order), and a sum that cancels keeps those
    operand ulps, so the unit is ulp(delta) + Σ_r ulp(partial_r) (float64, [S, H])."""
    from ref._num import Num
    from ref.o_proj import o_proj_partial

    from .metrics import bf16_ulp_t

    num = Num("exact")
    unit = bf16_ulp_t(delta.to(torch.float64).abs())
    for a in ranks:
        unit = unit + bf16_ulp_t(o_proj_partial(a["core"], a["w_o"], num).to(torch.float64).abs()).to(unit.device)
    return unit
