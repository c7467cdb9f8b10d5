"""`k3verify replay DIR --backend B`: replay captured decode steps through a backend and
the reference, judge every stage in both views (chained and isolated) against the
tolerance policy, write reports.

Exit codes: 0 every criterion held, 1 the numerics failed, 2 bad input or usage, 3 the
harness could not finish (a capture hit the time limit, a report could not be written).

Library use::

    run = replay("golden/", "triton", device="cuda")   # -> results.Run
    run.passed, run.exit_code()
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch

from .engine import DEFAULT_TIMEOUT, Step, run_step
from .errors import EXIT_HELP, EXIT_INCOMPLETE, Incomplete, InputError


def step_from_set(cs, device) -> Step:
    """A capture set (harness.capture.CaptureSet) as the engine's Step, tensors on `device`."""
    k1 = None
    if cs.has_k1:
        k1 = [cs.k1_args(r, device, layout="compact", poison=False) for r in cs.ranks]
    k2 = cs.k2_world_args(device)
    return Step(cs.name, cs.layer, cs.kind, cs.step, cs.world, cs.fmt, cs.k1_key, cs.k2_key, k1, k2,
                meta={"path": str(cs.path), "config": cs.config_name})


def _remap_rows(m: dict, rows) -> None:
    """Token indices of a row subset back to the full tensor's."""
    if rows is None:
        return
    for k in ("worst", "worst_ulp"):
        loc = m.get(k)
        if loc and "token" in loc:
            loc["token"] = rows[loc["token"]]


def judge_run(step_run, policy, cap) -> None:
    """Turn the engine's pairs into judged Comparisons on `cap` (a results.CaptureResult): every
    metric computed on the pairs' device, one host transfer for the whole step. A pair that
    cannot be compared (a tap of the wrong shape) is a capture error, not a traceback."""
    from .metrics import Batch, ShapeMismatch, compare_picks
    from .results import Comparison

    st = step_run.step
    config = st.meta.get("config")
    jobs, batch = [], Batch()
    for p in step_run.pairs:
        try:
            routing = None
            if p.stage == "k2" and p.name == "topk_ids" and p.view == "chained" and p.rank in step_run.routing:
                routing = step_run.routing[p.rank]
            kw = policy.compare_kw(p.stage, p.name, st.fmt, p.view, config)
            if p.keys_from is not None:
                win = policy.criteria(p.stage, p.name, st.fmt, p.view, config).get("tie_eps") or 0.0
                routing = compare_picks(p.cand, p.ref, *p.keys_from, float(win), p.dims)
            main = None if routing is not None else batch.add(p.cand, p.ref, p.dims, **kw, ulp_unit=p.ulp_unit)
            orc = None
            if p.oracle is not None and p.cand.is_floating_point():
                orc = (batch.add(p.cand, p.oracle, p.dims, detail=False), batch.add(p.ref, p.oracle, p.dims, detail=False))
            noise = [batch.add(n, p.ref, p.dims, detail=False) for n in p.noise]
        except ShapeMismatch as e:
            cap.errors.append(f"{p.stage}/{p.name} ({p.view}) rank {p.rank}: the backend's tensor has the wrong "
                              f"shape: {e}")
            continue
        jobs.append((p, routing, main, orc, noise))
    done = batch.run()
    for p, routing, main, orc, noise in jobs:
        m = routing if routing is not None else done[main]
        _remap_rows(m, p.rows)
        oracle = None if orc is None else {"fast": done[orc[0]], "ref": done[orc[1]]}
        nz = [done[n] for n in noise] or None
        cap.comparisons.append(Comparison.judged(
            policy, capture=cap.id, layer=st.layer, kind=st.kind, step=st.step, rank=p.rank, stage=p.stage,
            output=p.name, view=p.view, fmt=st.fmt, metrics=m, oracle=oracle, noise=nz, note=p.note,
            config=config))


def resolve_device(device: str | None) -> str:
    """--device -> a torch device string; a device this machine lacks is bad input."""
    if not device:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError("--device", f"{device!r} is not a torch device (cpu, cuda, cuda:N)") from None
    if d.type == "cpu":
        return str(d)
    if d.type != "cuda":
        raise InputError("--device", f"{device!r}: k3verify replays on cpu or cuda (ROCm is 'cuda' in torch)")
    if not torch.cuda.is_available():
        raise InputError("--device", f"{device!r} asked for, but torch sees no CUDA/ROCm device here")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise InputError("--device", f"{device!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return str(d)


_SET_RE = re.compile(r"^s(\d+)_l(\d+)$")


def _corpus_key(p: Path) -> tuple:
    """(folder, 0, layer, step) of a set named s<step>_l<layer>; (folder, 1, name, 0) otherwise."""
    m = _SET_RE.match(p.name)
    return (str(p.parent), 0, int(m.group(2)), int(m.group(1))) if m else (str(p.parent), 1, p.name, 0)


def corpus_order(paths) -> list[Path]:
    """A layer's steps together (its weights stay loaded): by folder, layer, then step."""
    return sorted((Path(p) for p in paths), key=_corpus_key)


def retire_layers(paths):
    """Yield `paths` (in corpus order); when the next set starts another (folder, layer), the
    weight cache is emptied first: corpus order never comes back to a layer, so its weights
    would only hold device memory the next layer needs (a flat memory curve over the corpus)."""
    from .capture.sources import CACHE

    group = None
    for p in paths:
        g = _corpus_key(Path(p))[:3]
        if group is not None and g != group:
            CACHE.clear()
        group = g
        yield p


def _device_alive(device: str, wait: float = 10.0) -> bool:
    """After a time limit: does the device still answer (a hung kernel blocks every later launch)?"""
    if not device.startswith("cuda"):
        return True
    from .engine import BackendTimeout, _deadline

    try:
        _deadline(lambda: torch.cuda.synchronize(torch.device(device)), wait, "device synchronize")
        return True
    except BackendTimeout:
        return False


def checked_backend(spec: str, field: str = "--backend"):
    """The backend `spec` names, loaded and available here (else InputError: exit 2)."""
    from fast import BackendError, available, load_backend

    try:
        backend = load_backend(spec)
    except BackendError as e:
        raise InputError(field, str(e).split(": ", 1)[-1]) from None
    ok, why = available(backend)
    if not ok:
        raise InputError(field, f"{spec} is not available here: {why}")
    return backend


def replay(captures, backend_spec: str = "ref", device: str | None = None, policy_path=None, isolate: bool = True,
           noise: int = 0, progress: bool = True, limit: int | None = None, seed: int = 0,
           timeout: float | None = DEFAULT_TIMEOUT, verify: str = "once"):
    """Replay every capture set under `captures` (a folder, or a list of set folders).

    verify: weight files hashed once per process ("once"), every time ("full") or never
    ("none"); recipe weights are regenerated on `device` and their digests checked there.

    seed: the poisons of set i are drawn from seed + i (the pytest plugin passes the test id's).
    timeout: seconds the backend may take for one capture set (None: no limit); a set that
    runs over fails with the reason and the run goes on (exit 3)."""
    from fast import backend_name

    from .capture import discover, load_set
    from .policy import load_policy
    from .results import CaptureResult, Run, collect_env

    if limit is not None and limit < 1:
        raise InputError("--limit", f"{limit} < 1")
    if noise < 0:
        raise InputError("--noise", f"{noise} < 0")
    if timeout is not None and not timeout > 0:
        raise InputError("--timeout", f"{timeout} is not a positive number of seconds")
    backend = checked_backend(backend_spec)
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
    paths = corpus_order(paths)
    if limit:
        paths = paths[:limit]
    name = backend_name(backend, backend_spec)
    run = Run(backend=name, device=_device_label(device), arch=_arch(device), env=collect_env(backend, device),
              policy=str(policy.path), options={"isolate": isolate, "noise": noise, "captures": str(captures),
                                                "backend_spec": backend_spec, "timeout": timeout})
    t_run = time.perf_counter()
    it = paths
    if progress:
        from tqdm import tqdm

        it = tqdm(paths, desc=f"replay [{name}]", unit="set", file=sys.stderr, leave=False)
    it = retire_layers(it)
    wedged = None
    cs = step = sr = None
    for i, path in enumerate(it):
        cs = step = sr = None  # the previous set's tensors go before the next set is read
        t0 = time.perf_counter()
        cs = load_set(path, verify, device=device)
        cap = CaptureResult(id=cs.name, fmt=cs.fmt, layer=cs.layer, kind=cs.kind, step=cs.step, world=cs.world)
        run.captures.append(cap)
        if wedged:
            cap.aborted = f"not run: {wedged}"
            continue
        step = step_from_set(cs, device)
        cap.timings["load"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            sr = run_step(step, backend, isolate=isolate, noise=noise, seed=seed + i,
                          tie_eps=policy.tie_eps(cs.fmt, cs.config_name), timeout=timeout)
        except Exception as e:  # noqa: BLE001 - a backend that raises fails its capture, the run goes on
            cap.errors.append(f"backend raised {type(e).__name__}: {e}")
            continue
        cap.timings["run"] = time.perf_counter() - t1
        if sr.aborted:
            cap.aborted = sr.aborted
            if not _device_alive(device):
                wedged = f"{device} still runs the launch that timed out on {cs.name}"
            continue
        cap.missing_taps = sr.missing_taps
        cap.errors.extend(sr.errors)
        if sr.forced_routing:
            cap.notes.append("routing differs at a near-tie of the oracle's keys: downstream judged with the "
                             "backend's routing forced")
        t2 = time.perf_counter()
        judge_run(sr, policy, cap)
        cap.timings["judge"] = time.perf_counter() - t2
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


def check_outputs(**paths) -> None:
    """Report targets must be writable files before the long work starts (InputError, exit 2)."""
    for opt, p in paths.items():
        if not p:
            continue
        p = Path(p)
        flag = f"--{opt}"
        if p.is_dir():
            raise InputError(flag, f"{p} is a folder")
        if p.exists() and not p.is_file():
            raise InputError(flag, f"{p} exists and is not a regular file")
        anc = p.parent
        while not anc.exists():
            anc = anc.parent
        if not anc.is_dir():
            raise InputError(flag, f"{anc} is a file, so {p} cannot be written")
        if not os.access(anc, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
            raise InputError(flag, f"{p} cannot be written (no write permission in {anc})")


def write_reports(run, md=None, json_path=None, html=None) -> list[str]:
    """Write the requested reports; returns one line per file written (and notes). Every report
    is attempted; if any could not be written, Incomplete (exit 3) lists them after the rest."""
    from . import report

    lines, failed = [], []
    for kind, path in (("md", md), ("json", json_path), ("html", html)):
        if not path:
            continue
        try:
            lines += [f"wrote {path}"] + list(report.write_reports(run, **{kind: path}))
        except OSError as e:
            failed.append(f"{path}: {e.strerror or e}")
    if failed:
        raise Incomplete("could not write " + "; ".join(failed))
    return lines


def _print(*lines) -> None:
    """stdout that survives a closed pipe (`replay ... | head`): the rest is dropped quietly."""
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def build_parser() -> argparse.ArgumentParser:
    from .errors import ArgParser

    ap = ArgParser(prog="k3verify replay", description=__doc__.split("\n\n")[0], epilog=EXIT_HELP)
    ap.add_argument("captures", help="folder of capture sets (searched recursively)")
    ap.add_argument("--backend", default="ref", help="ref | triton | flydsl | vllm-mono | package.module:object")
    ap.add_argument("--device", help="torch device (default: cuda if there is one, else cpu)")
    ap.add_argument("--policy", help="tolerance policy TOML (default golden/tolerances.toml)")
    ap.add_argument("--report", help="write the Markdown report here")
    ap.add_argument("--json", help="write the JSON report here")
    ap.add_argument("--html", help="write the HTML report (plots) here")
    ap.add_argument("--isolate", action="store_true", help="(the default) also judge each stage fed the backend's "
                                                           "previous tap")
    ap.add_argument("--no-isolate", action="store_true", help="judge the chained view only")
    ap.add_argument("--noise", type=int, default=0, metavar="N", help="judge against N perturbed reference runs")
    ap.add_argument("--limit", type=int, help="replay only the first N capture sets")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                    help=f"seconds the backend may take per capture set (default {DEFAULT_TIMEOUT:g}; 0: no limit)")
    ap.add_argument("--verify", default="once", choices=("once", "full", "none"),
                    help="weight checks: once per process (default), full (re-hash every set), none")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def cli(argv) -> int:
    a = build_parser().parse_args(argv)
    if a.isolate and a.no_isolate:
        raise InputError("--no-isolate", "contradicts --isolate")
    if a.timeout < 0:
        raise InputError("--timeout", f"{a.timeout} < 0")
    check_outputs(report=a.report, json=a.json, html=a.html)
    run = replay(a.captures, a.backend, a.device, a.policy, not a.no_isolate, a.noise, progress=not a.quiet,
                 limit=a.limit, timeout=a.timeout or None, verify=a.verify)
    from . import report

    code = run.exit_code()
    try:
        lines = write_reports(run, a.report, a.json, a.html)
    except Incomplete as e:
        lines = [f"k3verify replay: error: {e}"]
        code = EXIT_INCOMPLETE
    _print(report.summary_line(run), report.stage_table(run), *report.problem_lines(run), *lines)
    return code
