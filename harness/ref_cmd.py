"""`k3verify ref`: run the reference (exact and oracle) over one synthetic step of one
layer on every rank and print, per stage, how far exact mode lies from the fp64 oracle."""
from __future__ import annotations

import argparse
import time

import torch
from tabulate import tabulate

from .errors import InputError


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    n = b.norm().item()
    return (a - b).norm().item() / n if n else float((a - b).norm().item() != 0) * float("inf")


def run(cfg_name="tiny", experts="mxfp4", layer=1, requests=2, qlen=4, seed=0, device="cpu"):
    import ref
    from ref.config import get_config
    from ref.synth import step_inputs

    try:
        cfg = get_config(cfg_name)
    except ValueError as e:
        raise InputError("--config", str(e).split(": ", 1)[1]) from None
    if not 0 <= layer < cfg.layers or cfg.is_mla(layer):
        raise InputError("--layer", f"{layer} is not a KDA layer of {cfg.name} (0..{cfg.layers - 1})")
    k1k, k1s, k2k, k2s = step_inputs(cfg, layer, requests, qlen, experts, seed, device)
    orc1 = [ref.abi.oracle_args(a) for a in k1s]  # weights stay shared in their stored dtype
    orc2 = []
    for a, o in zip(k2s, orc1):
        b = ref.abi.oracle_args(a)
        b.update(core=o["core_out"], prefix=o["prefix"], blocks=o["blocks"])
        orc2.append(b)
    taps = {"exact": ([{} for _ in k1s], [{} for _ in k2s]), "oracle": ([{} for _ in k1s], [{} for _ in k2s])}
    times = {}
    for mode, (a1, a2) in (("exact", (k1s, k2s)), ("oracle", (orc1, orc2))):
        t0 = time.perf_counter()
        for args, t in zip(a1, taps[mode][0]):
            ref.kda_pre(k1k, **args, taps=t, mode=mode)
        for args, t in zip(a2, taps[mode][1]):
            args["taps"] = t
        ref.k2_world(k2k, a2, mode=mode)
        times[mode] = time.perf_counter() - t0
    rows = []
    for i, stage in ((0, "k1"), (1, "k2")):
        ex, orc = taps["exact"][i][0], taps["oracle"][i][0]
        for name in ex:
            if name == "topk_ids":
                same = (ex[name] == orc[name]).float().mean().item()
                rows.append([stage, name, f"{same:.4f} ids equal", ""])
                continue
            rows.append([stage, name, f"{_rel(ex[name], orc[name]):.3e}", tuple(ex[name].shape)])
    rows.append(["k1", "core_out", f"{_rel(k1s[0]['core_out'], orc1[0]['core_out']):.3e}", tuple(k1s[0]["core_out"].shape)])
    rows.append(["k2", "out", f"{_rel(k2s[0]['out'], orc2[0]['out']):.3e}", tuple(k2s[0]["out"].shape)])
    same = all(torch.equal(k2s[0]["out"], a["out"]) for a in k2s)
    return rows, times, same, cfg


def cli(argv) -> int:
    ap = argparse.ArgumentParser(prog="k3verify ref", description=__doc__)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--experts", default="mxfp4", choices=["bf16", "mxfp4", "int4"])
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--qlen", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    rows, times, same, cfg = run(a.config, a.experts, a.layer, a.requests, a.qlen, a.seed, a.device)
    print(f"reference, {cfg.name} layer {a.layer}, {a.experts} experts, world {cfg.world}, "
          f"S={a.requests * a.qlen} (R={a.requests}, L={a.qlen}); exact {times['exact'] * 1e3:.1f} ms, "
          f"oracle {times['oracle'] * 1e3:.1f} ms; out identical on every rank: {same}")
    print(tabulate(rows, headers=["stage", "tap/output", "rel L2 exact vs oracle (rank 0)", "shape"]))
    return 0
