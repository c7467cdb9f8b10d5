"""`k3verify demo`: the main job on an embedded default.

Synthesizes tiny captures (every layer of the tiny stack, a few speculative steps),
replays them through the best fused backend available here — Triton on a GPU, else
Triton interpreted on the CPU, else the reference itself — writes the Markdown, JSON
and HTML reports and prints the summary and where they are.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from .errors import InputError


def pick_backend(requested: str | None) -> tuple[str, str | None, str]:
    """(backend spec, device, why) for the demo."""
    if requested:
        return requested, None, "requested"
    import torch

    if torch.cuda.is_available():
        try:
            import triton  # noqa: F401
            return "triton", "cuda", "GPU present"
        except ImportError:
            return "ref", "cuda", "triton not installed"
    try:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "ref", "cpu", "no GPU and triton not installed"
    except ValueError:
        pass
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    from fast import available, load_backend

    try:
        ok, why = available(load_backend("triton"))
    except Exception as e:  # noqa: BLE001 - the demo falls back to the reference
        ok, why = False, f"{type(e).__name__}: {e}"
    if ok:
        return "triton", "cpu", "no GPU: Triton interpreted on the CPU (TRITON_INTERPRET=1)"
    return "ref", "cpu", f"triton unavailable ({why})"


def cli(argv) -> int:
    from .errors import EXIT_HELP, ArgParser

    ap = ArgParser(prog="k3verify demo", description=__doc__.split("\n\n")[0], epilog=EXIT_HELP)
    ap.add_argument("--out", help="folder for captures and reports (default: a new temp folder)")
    ap.add_argument("--backend", help="override the backend choice (ref | triton | flydsl | module:object)")
    from ref.config import EXPERT_FORMATS

    ap.add_argument("--experts", default="mxfp4", choices=list(EXPERT_FORMATS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-isolate", action="store_true", help="judge the chained view only (default: both views)")
    a = ap.parse_args(argv)
    if a.steps < 1:
        raise InputError("--steps", f"{a.steps} < 1")
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="k3verify-demo-"))
    caps = out / "captures"
    if caps.exists() and (not caps.is_dir() or any(caps.iterdir())):
        raise InputError("--out", f"{caps} already holds captures; choose an empty folder")
    from .replay import check_outputs

    check_outputs(out=out / "report.md")
    spec, device, why = pick_backend(a.backend)
    from .replay import _print, replay, write_reports
    from .report import problem_lines, stage_table, summary_line
    from .synth import synthesize

    print(f"k3verify demo: synthesizing tiny captures into {caps}", file=sys.stderr)
    synthesize("tiny", layers=None, steps=a.steps, num_spec=3, experts=a.experts, seed=a.seed, out=caps,
               progress=True)
    print(f"k3verify demo: replaying through backend {spec!r} ({why})", file=sys.stderr)
    run = replay(caps, spec, device, isolate=not a.no_isolate, progress=True)
    lines = write_reports(run, out / "report.md", out / "report.json", out / "report.html")
    _print(summary_line(run), stage_table(run), *problem_lines(run), *lines)
    return run.exit_code()
