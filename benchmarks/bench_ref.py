"""Time the eager reference on one k3-tp8 decode step (K1 + K2 on every rank of a
simulated world 8), exact and oracle: median over repeats and peak device memory.

    PYTHONPATH=. python benchmarks/bench_ref.py [--config k3-tp8] [--requests 1 --qlen 4]
        [--experts mxfp4] [--repeats 10] [--captures DIR] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import ref
from ref.config import get_config
from ref.synth import step_inputs


def _sync(dev):
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def _snapshot(args_list):
    """Copies of every tensor a step writes, to restore before each repeat."""
    names = ("prefix", "blocks", "conv_state", "rstate", "core_out", "out")
    return [{n: a[n].clone() for n in names if n in a} for a in args_list]


def _restore(args_list, snap):
    for a, s in zip(args_list, snap):
        for n, t in s.items():
            a[n].copy_(t)


def step(k1k, k1s, k2k, k2s, mode):
    for a in k1s:
        ref.kda_pre(k1k, **a, mode=mode)
    ref.k2_world(k2k, k2s, mode=mode)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="k3-tp8")
    ap.add_argument("--experts", default="mxfp4")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--qlen", type=int, default=4)
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--captures", help="take the step from a capture set instead of synthesizing one")
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="print the top ops of one exact step")
    a = ap.parse_args(argv)
    dev = a.device
    t0 = time.perf_counter()
    if a.captures:  # a KDA capture set (e.g. from `k3verify synth --config k3-tp8`)
        from harness.capture import discover, load_set

        cs = next(c for c in map(load_set, discover(a.captures) or [a.captures]) if c.kind == "kda")
        cfg, k1k, k2k = cs.cfg, cs.k1_key, cs.k2_key
        k1s = [cs.k1_args(r, dev, poison=False) for r in cs.ranks]
        k2s = cs.k2_world_args(dev)
        for x, y in zip(k1s, k2s):  # chain K2 on K1's outputs, as the model does
            y.update(core=x["core_out"], prefix=x["prefix"], blocks=x["blocks"])
        a.experts, a.qlen = cs.fmt, k1k.qlen
        a.requests = k1k.tokens // k1k.qlen
    else:
        cfg = get_config(a.config)
        k1k, k1s, k2k, k2s = step_inputs(cfg, a.layer, a.requests, a.qlen, a.experts, seed=0, device=dev)
    _sync(dev)
    print(f"inputs: {cfg.name} world {cfg.world} S={a.requests * a.qlen} {a.experts}: "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    orc1 = [ref.upcast(x) for x in k1s]
    orc2 = []
    for x, o in zip(k2s, orc1):
        y = ref.upcast({k: v for k, v in x.items() if k not in ("core", "prefix", "blocks")})
        y.update(core=o["core_out"], prefix=o["prefix"], blocks=o["blocks"])
        orc2.append(y)
    res = {"config": cfg.name, "S": a.requests * a.qlen, "L": a.qlen, "world": cfg.world, "experts": a.experts,
           "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"}
    for mode, (x1, x2) in (("exact", (k1s, k2s)), ("oracle", (orc1, orc2))):
        snap = _snapshot(x1) + _snapshot(x2)
        step(k1k, x1, k2k, x2, mode)  # warm-up
        _sync(dev)
        if dev.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if dev.startswith("cuda") else 0
        ts = []
        for _ in range(a.repeats):
            _restore(x1 + x2, snap)
            _sync(dev)
            t = time.perf_counter()
            step(k1k, x1, k2k, x2, mode)
            _sync(dev)
            ts.append(time.perf_counter() - t)
        peak = (torch.cuda.max_memory_allocated() - base) if dev.startswith("cuda") else 0
        res[mode] = {"median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3,
                     "peak_extra_gib": peak / 2 ** 30}
        print(f"{mode:6s}: median {res[mode]['median_ms']:8.2f} ms  min {res[mode]['min_ms']:8.2f} ms  "
              f"peak memory above inputs {res[mode]['peak_extra_gib']:.2f} GiB  ({a.repeats} repeats)")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
        with profile(activities=acts) as prof:
            step(k1k, k1s, k2k, k2s, "exact")
            _sync(dev)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=40))
    if dev.startswith("cuda"):
        res["resident_gib"] = torch.cuda.memory_allocated() / 2 ** 30
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
