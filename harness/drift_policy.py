"""The drift policy of `k3verify drift` (docs/drift.md) and the measurement behind it.

Per step, layer and tracked tensor the backend's distance from the oracle may be at most
`k` times the reference's own distance from the oracle plus a floor (rel L2 over live rows
and live slots), NaN and Inf never pass, and the exact rules hold (every rank's `out`
bit-identical, padding rows of `core_out` exactly 0, routing differences only at near-ties of
the oracle's keys).

Where k and the floor come from: `python -m harness.drift_policy` runs benign reorderings (the
reference under `perturb` = split-K chunk order of every GEMM and the chunk order of every other
reduction, a fixed permutation per seed) closed-loop as the backend, and prints per tensor the
largest ratio d(benign, oracle) / d(ref, oracle) and the largest d(benign, oracle) seen where
the reference's own distance is below the floor's scale. MEASURED records its output; K and
FLOOR sit above it by the margins stated there.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

TENSORS = ("conv", "rstate", "core", "prefix", "logits", "out")

# `python -m harness.drift_policy --steps 256 --seeds 1,2 --experts mxfp4,int4,bf16` on this
# project's CPU machine (AMD EPYC, 1 thread; tiny, layers 0-5, num_spec 3, R = 2, lifetime 64,
# accept random), 2026-12-03: the largest d(benign, oracle) / d(ref, oracle) over 6 runs of 256
# steps, per tensor (d(ref, oracle) was never below 1e-4, so no run constrained the floor):
MEASURED = {
    "coupled": {"conv": 1.0042, "rstate": 1.0197, "core": 1.1140, "prefix": 1.0056, "logits": 1.0989,
                "out": 1.1694},
    # the same with --chain (each copy on its own residual stream through the stack): a benign
    # reordering's rounding differences flip bf16 roundings and MXFP4 codes and are amplified
    # layer after layer, so the ratio says nothing about the backend: chain is measured, not judged
    "chain": {"conv": 14.95, "rstate": 1.790, "core": 4.003, "prefix": 4.137, "logits": 6.839, "out": 15.45},
}

# k: 1.28x the largest benign ratio (1.17, `out` int4), rounded up to 1.5. The planted slow bugs
# (tests/drift_bugs.py) reach ratios of 3 (recurrent state stored in bf16) to 20 (decay gain) in
# 256 steps, and cross 1.5 within 10 steps.
K = 1.5
# floor: fp32 resolution of a relative distance (2^-20), for tensors where the reference and the
# oracle agree exactly (then only fp32 reordering noise may separate the backend)
FLOOR = 2.0 ** -20


def limit(tensor: str, d_ro: float) -> float:
    """The largest d(backend, oracle) that passes, given the reference's own d(ref, oracle)."""
    return K * d_ro + FLOOR


def passes(tensor: str, d_bo: float, d_ro: float) -> bool:
    return math.isfinite(d_bo) and d_bo <= limit(tensor, d_ro)


# ----------------------------------------------------------------------------- the measurement

def measure(steps: int, seeds, formats, config: str = "tiny", layers: str | None = None, num_spec: int = 3,
            lifetime: int = 64, accept: str = "random", progress: bool = True, chain: bool = False) -> dict:
    """Benign reorderings closed-loop: per tensor, the worst ratio d_bo / d_ro where d_ro is at
    least 1e-4 (above the floor's scale), and the worst d_bo where it is not."""
    from .derive import PerturbedRef
    from .drift import drift

    out: dict = {t: {"ratio_max": 0.0, "small_ro_bo_max": 0.0, "at": None} for t in TENSORS}
    runs = []
    for fmt in formats:
        for s in seeds:
            run = drift(config, layers, steps, num_spec, PerturbedRef(s), experts=fmt, accept=accept, lifetime=lifetime,
                        seed=1000 + s, progress=progress, judge=False, chain=chain)
            runs.append({"experts": fmt, "perturb": s, "steps": run.steps_run, "seconds": round(run.seconds, 1)})
            for (layer, tensor), ser in run.series.items():
                if tensor not in out:
                    continue
                for t, (bo, ro) in enumerate(zip(ser["bo"], ser["ro"])):
                    if bo is None or ro is None:
                        continue
                    m = out[tensor]
                    if ro >= 1e-4:
                        r = bo / ro
                        if r > m["ratio_max"]:
                            m.update(ratio_max=r, at={"experts": fmt, "perturb": s, "step": t, "layer": layer})
                    else:
                        m["small_ro_bo_max"] = max(m["small_ro_bo_max"], bo)
    return {"tensors": out, "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.drift_policy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--seeds", default="1,2,3,4")
    ap.add_argument("--experts", default="mxfp4,int4,bf16")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--layers", default=None)
    ap.add_argument("--chain", action="store_true", help="each copy on its own residual stream too")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    res = measure(a.steps, [int(s) for s in a.seeds.split(",")], a.experts.split(","), a.config, a.layers,
                  progress=not a.quiet, chain=a.chain)
    json.dump(res, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
