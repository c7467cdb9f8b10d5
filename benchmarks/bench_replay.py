"""Corpus scale at the real shape (issue I, DESIGN §11): make, store and replay a k3-tp8 corpus
on one GPU, and print one table.

    PYTHONPATH=. python benchmarks/bench_replay.py [--config k3-tp8] [--layers 1-2] [--steps 8]
        [--backend triton] [--experts mxfp4] [--out DIR] [--json F]
        [--synth-only] [--captures DIR]     # make the corpus, or replay one made before

Measures (a fresh process, one device):
- synth: total and per layer-step (`harness.synth.synthesize`, the device given), disk bytes;
- replay, set by set in corpus order (a layer's steps together), chained + isolated through the
  backend: load, run (the three sides, both views) and judge seconds, and the peak device memory
  after every set (torch.cuda.max_memory_allocated, reset before each set);
- the reference's own exact step (K1 + K2 of every rank) on one of the sets, median of repeats.
The first set of a layer pays for loading (or regenerating) its weights; later sets reuse them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _profiler(on: bool):
    """call(what, fn, *args) -> fn(*args); with `on`, under cProfile, printing the top 40."""
    def call(what, fn, *args, **kw):
        if not on:
            return fn(*args, **kw)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        out = prof.runcall(fn, *args, **kw)
        print(f"--- profile: {what}")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        return out
    return call


def ref_step_ms(cs, device, repeats: int) -> list[float]:
    """The exact reference on one capture set: K1 of every rank then K2 of the world."""
    import ref
    from harness.engine import chain_k2
    from harness.replay import step_from_set

    step = step_from_set(cs, device)
    times = []
    for _ in range(repeats + 1):
        k1 = None
        if step.k1 is not None:
            k1 = [dict(a, **{n: a[n].clone() for n in ("prefix", "blocks", "conv_state", "rstate", "core_out")})
                  for a in step.k1]
        k2 = None if step.k2 is None else chain_k2(None, step.k2)
        _sync(device)
        t0 = time.perf_counter()
        if k1 is not None:
            for a in k1:
                ref.kda_pre(step.k1_key, **a)
        if k2 is not None:
            if k1 is not None:
                for a, b in zip(k2, k1):
                    a.update(core=b["core_out"], prefix=b["prefix"], blocks=b["blocks"])
            ref.k2_world(step.k2_key, k2)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times[1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="k3-tp8")
    ap.add_argument("--layers", default="1-2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--experts", default="mxfp4")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="corpus folder (default: a temp folder)")
    ap.add_argument("--repeats", type=int, default=5, help="reference step repeats")
    ap.add_argument("--no-isolate", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--synth-only", action="store_true", help="make the corpus (timed) and stop")
    ap.add_argument("--captures", help="replay this corpus instead of making one")
    ap.add_argument("--profile", type=int, metavar="N", help="profile set N's load, run and judge (cProfile, top 40 each)")
    a = ap.parse_args(argv)
    from harness.capture import discover, load_set
    from harness.policy import load_policy
    from harness.replay import corpus_order, judge_run, retire_layers, step_from_set
    from harness.results import CaptureResult
    from harness.engine import run_step
    from harness.synth import synthesize
    from fast import load_backend

    dev = a.device
    out = Path(a.out or tempfile.mkdtemp(prefix="k3-corpus-"))
    res: dict = {"config": a.config, "layers": a.layers, "steps": a.steps, "experts": a.experts,
                 "backend": a.backend, "device": torch.cuda.get_device_name() if dev.startswith("cuda") else dev}
    if a.captures:
        out = Path(a.captures)
        sets = discover(out)
    else:
        t0 = time.perf_counter()
        sets = synthesize(a.config, a.layers, a.steps, a.num_spec, a.experts, 0, out, requests=a.requests,
                          device=dev, progress=True, git=False)
        _sync(dev)
        res["synth_s"] = time.perf_counter() - t0
        res["synth_per_set_s"] = res["synth_s"] / max(1, len(sets))
    res["disk_bytes"] = _du(out)
    res["sets"] = len(sets)
    if a.synth_only:
        print(f"synth: {res['sets']} sets in {res['synth_s']:.1f} s ({res['synth_per_set_s']:.2f} s per "
              f"layer-step), {res['disk_bytes'] / 1e6:.1f} MB on disk, in {out}")
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1, default=str))
        return 0
    backend = load_backend(a.backend)
    policy = load_policy()
    rows = []
    seen_layers = set()
    for i, path in enumerate(retire_layers(corpus_order(discover(out)))):
        if dev.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        prof = _profiler(a.profile == i + 1)
        t_load = time.perf_counter()
        cs = prof("load", load_set, path, device=dev)
        step = step_from_set(cs, dev)
        _sync(dev)
        load = time.perf_counter() - t_load
        t_run = time.perf_counter()
        sr = prof("run", run_step, step, backend, isolate=not a.no_isolate, seed=i,
                  tie_eps=policy.tie_eps(cs.fmt, cs.config_name))
        _sync(dev)
        run = time.perf_counter() - t_run
        cap = CaptureResult(id=cs.name, fmt=cs.fmt, layer=cs.layer, kind=cs.kind, step=cs.step, world=cs.world)
        cap.errors += sr.errors
        t_judge = time.perf_counter()
        prof("judge", judge_run, sr, policy, cap)
        judge = time.perf_counter() - t_judge
        del sr, step
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if dev.startswith("cuda") else float("nan")
        first = cs.layer not in seen_layers
        seen_layers.add(cs.layer)
        rows.append({"set": cs.name, "layer": cs.layer, "first_of_layer": first, "load_s": load, "run_s": run,
                     "judge_s": judge, "peak_gib": peak, "passed": cap.passed,
                     "failed": [f"{c.stage}/{c.output}/{c.view}" for c in cap.failed][:6], "errors": cap.errors[:2]})
        print(f"set {i + 1:3d} {cs.name}: load {load:6.2f} s, run {run:6.2f} s, judge {judge:5.2f} s, peak "
              f"{peak:6.1f} GiB, {'PASS' if cap.passed else 'FAIL ' + ' '.join(rows[-1]['failed'])}", flush=True)
    res["rows"] = rows
    later = [r for r in rows if not r["first_of_layer"]]
    first = [r for r in rows if r["first_of_layer"]]
    res["steady_set_s"] = statistics.median(r["load_s"] + r["run_s"] + r["judge_s"] for r in later) if later else None
    res["first_set_s"] = max(r["load_s"] + r["run_s"] + r["judge_s"] for r in first) if first else None
    if len(rows) >= 2 and dev.startswith("cuda"):
        res["peak_ratio_last_vs_2nd"] = rows[-1]["peak_gib"] / rows[1]["peak_gib"]
    cs = load_set(corpus_order(discover(out))[0], device=dev)
    res["ref_step_ms"] = ref_step_ms(cs, dev, a.repeats)
    res["all_passed"] = all(r["passed"] for r in rows)
    print()
    what = f"{a.captures}" if a.captures else f"{a.config} layers {a.layers} x {a.steps} steps, {a.experts}"
    print(f"corpus: {what}, {res['sets']} sets, backend {a.backend}, device {res['device']}")
    print(f"| synth s | per set s | disk MB | first set s | steady set s | peak GiB set 2 / last | ratio | "
          f"ref step ms (median, min) | all pass |")
    print("|---|---|---|---|---|---|---|---|---|")
    pk = f"{rows[1]['peak_gib']:.1f} / {rows[-1]['peak_gib']:.1f}" if len(rows) >= 2 else "—"
    print(f"| {res.get('synth_s', float('nan')):.1f} | {res.get('synth_per_set_s', float('nan')):.2f} | {res['disk_bytes'] / 1e6:.1f} | "
          f"{res['first_set_s']:.2f} | {res['steady_set_s'] if res['steady_set_s'] is None else round(res['steady_set_s'], 2)} | "
          f"{pk} | {res.get('peak_ratio_last_vs_2nd', float('nan')):.3f} | "
          f"{statistics.median(res['ref_step_ms']):.1f}, {min(res['ref_step_ms']):.1f} | {res['all_passed']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0 if res["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
