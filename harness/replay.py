"""`k3verify replay DIR --backend B`: replay captured decode steps through a backend and
the reference, judge every stage against the tolerance policy, write reports.

Exit 0 when every criterion holds, 1 when any fails, 2 for bad input or usage.

Library use::

    run = replay("golden/", "triton", device="cuda", isolate=True)   # -> results.Run
    run.passed
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .engine import Step, run_step
from .errors import InputError


def step_from_set(cs, device) -> Step:
    """A capture set (harness.capture.CaptureSet) as the engine's Step, tensors on `device`."""
    k1 = None
    if cs.has_k1:
        k1 = [cs.k1_args(r, device, layout="compact", poison=False) for r in cs.ranks]
    k2 = cs.k2_world_args(device)
    return Step(cs.name, cs.layer, cs.kind, cs.step, cs.world, cs.fmt, cs.k1_key, cs.k2_key, k1, k2,
                meta={"path": str(cs.path)})


def judge_run(step_run, policy, cap) -> None:
    """Turn the engine's pairs into judged Comparisons on `cap` (a results.CaptureResult)."""
    from .metrics import compare
    from .results import Comparison

    st = step_run.step
    for p in step_run.pairs:
        if p.stage == "k2" and p.name == "topk_ids" and p.view == "chained" and p.rank in step_run.routing:
            m = step_run.routing[p.rank]
        else:
            m = compare(p.cand, p.ref, p.dims, **policy.compare_kw(p.stage, p.name, st.fmt, p.view))
        oracle = None
        if p.oracle is not None and p.cand.is_floating_point():
            oracle = {"fast": compare(p.cand, p.oracle, p.dims, detail=False),
                      "ref": compare(p.ref, p.oracle, p.dims, detail=False)}
        noise = [compare(n, p.ref, p.dims, detail=False) for n in p.noise] if p.noise else None
        cap.comparisons.append(Comparison.judged(
            policy, capture=cap.id, layer=st.layer, kind=st.kind, step=st.step, rank=p.rank, stage=p.stage,
            output=p.name, view=p.view, fmt=st.fmt, metrics=m, oracle=oracle, noise=noise, note=p.note))


def resolve_device(device: str | None) -> str:
    if device:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def replay(captures, backend_spec: str = "ref", device: str | None = None, policy_path=None, isolate=False,
           noise: int = 0, progress: bool = True, limit: int | None = None, seed: int = 0):
    """Replay every capture set under `captures` (a folder, or a list of set folders).

    seed: the poisons of set i are drawn from seed + i (the pytest plugin passes the test id's)."""
    from fast import available, backend_name, load_backend, BackendError

    from .capture import discover, load_set
    from .policy import load_policy
    from .results import CaptureResult, Run, collect_env

    try:
        backend = load_backend(backend_spec)
    except BackendError as e:
        raise InputError("--backend", str(e).split(": ", 1)[-1]) from None
    ok, why = available(backend)
    if not ok:
        raise InputError("--backend", f"{backend_spec} is not available here: {why}")
    device = resolve_device(device)
    policy = load_policy(policy_path)
    if isinstance(captures, (str, os.PathLike)):
        root = Path(captures)
        if not root.exists():
            raise InputError("captures", f"{root} does not exist")
        paths = discover(root)
        if not paths:
            raise InputError("captures", f"no capture sets under {root}")
    else:
        paths = [Path(p) for p in captures]
    if limit:
        paths = paths[:limit]
    name = backend_name(backend, backend_spec)
    run = Run(backend=name, device=_device_label(device), arch=_arch(device), env=collect_env(backend, device),
              policy=str(policy.path), options={"isolate": isolate, "noise": noise, "captures": str(captures),
                                                "backend_spec": backend_spec})
    t_run = time.perf_counter()
    it = paths
    if progress:
        from tqdm import tqdm

        it = tqdm(paths, desc=f"replay [{name}]", unit="set", file=sys.stderr, leave=False)
    for i, path in enumerate(it):
        t0 = time.perf_counter()
        cs = load_set(path)
        step = step_from_set(cs, device)
        cap = CaptureResult(id=cs.name, fmt=cs.fmt, layer=cs.layer, kind=cs.kind, step=cs.step, world=cs.world)
        cap.timings["load"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            sr = run_step(step, backend, isolate=isolate, noise=noise, seed=seed + i,
                          tie_eps=policy.tie_eps(cs.fmt))
        except Exception as e:  # a backend that raises fails its capture, the run goes on
            cap.errors.append(f"{type(e).__name__}: {e}")
            run.captures.append(cap)
            continue
        cap.timings["run"] = time.perf_counter() - t1
        cap.missing_taps = sr.missing_taps
        cap.errors.extend(sr.errors)
        if sr.forced_routing:
            cap.notes.append("routing differs at a near-tie of the oracle's keys: downstream judged with the "
                             "backend's routing forced")
        t2 = time.perf_counter()
        judge_run(sr, policy, cap)
        cap.timings["judge"] = time.perf_counter() - t2
        run.captures.append(cap)
    run.duration_s = time.perf_counter() - t_run
    return run


def _device_label(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def _arch(device: str) -> str | None:
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        if torch.version.hip:  # e.g. gfx942:sramecc+:xnack-
            return props.gcnArchName
        return f"sm_{props.major}{props.minor}"
    import platform

    return platform.machine()


def write_reports(run, md=None, json_path=None, html=None) -> list[str]:
    """Write the requested reports; returns one line per file written (and notes)."""
    from . import report

    notes = report.write_reports(run, md=md, json=json_path, html=html)
    return [f"wrote {p}" for p in (md, json_path, html) if p] + list(notes)


def cli(argv) -> int:
    ap = argparse.ArgumentParser(prog="k3verify replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("captures", help="folder of capture sets (searched recursively)")
    ap.add_argument("--backend", default="ref", help="ref | triton | flydsl | package.module:object")
    ap.add_argument("--device", help="torch device (default: cuda if there is one, else cpu)")
    ap.add_argument("--policy", help="tolerance policy TOML (default golden/tolerances.toml)")
    ap.add_argument("--report", help="write the Markdown report here")
    ap.add_argument("--json", help="write the JSON report here")
    ap.add_argument("--html", help="write the HTML report (plots) here")
    ap.add_argument("--isolate", action="store_true", help="also judge each stage fed the backend's previous tap")
    ap.add_argument("--noise", type=int, default=0, metavar="N", help="judge against N perturbed reference runs")
    ap.add_argument("--limit", type=int, help="replay only the first N capture sets")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    if a.noise < 0:
        raise InputError("--noise", f"{a.noise} < 0")
    for opt in ("report", "json", "html"):
        p = getattr(a, opt)
        if p and Path(p).is_dir():
            raise InputError(f"--{opt}", f"{p} is a folder")
    run = replay(a.captures, a.backend, a.device, a.policy, a.isolate, a.noise, progress=not a.quiet,
                 limit=a.limit)
    from . import report

    print(report.summary_line(run))
    print(report.stage_table(run))
    for line in write_reports(run, a.report, a.json, a.html):
        print(line)
    return 0 if run.passed else 1
