"""What a replay produces: comparisons, capture sets, a run (docs/report-schema.md).

API (what the replay fills):

    run = Run(backend="ref", device="cpu", arch="x86_64", env=collect_env(backend, "cpu"),
              policy=str(policy.path), options={"isolate": False, "noise": 0})
    cap = CaptureResult(id="s003-l02", fmt="mxfp4", layer=2, kind="kda", step=3, world=2)
    cap.comparisons.append(Comparison.judged(policy, capture=cap.id, layer=2, kind="kda",
                                             step=3, rank=0, stage="k2", output="y",
                                             view="chained", fmt=cap.fmt, metrics=m,
                                             oracle=o, noise=n))
    cap.missing_taps = {"k1": [...], "k2": [...]}; cap.timings["backend"] = 0.012
    cap.errors.append("backend raised ...")      # a capture with errors fails
    run.captures.append(cap); run.duration_s = ...
    text = run.to_json(); run2 = Run.from_json(text)   # also Run.load(path), run.save(path)

Untouched-memory checks are comparisons with stage "untouched" (metrics of
compare(after, before), criterion `exact`); `CaptureResult.untouched` lists them.
`passed` of a capture and of a run is derived (no errors, every comparison passed).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError
from .policy import VIEWS, CriterionResult, judge, passed as _all_passed  # VIEWS: re-exported

SCHEMA = "k3verify-report/1"


@dataclass
class Comparison:
    """One compared tensor: candidate vs reference for one stage output of one rank."""

    capture: str
    layer: int
    kind: str  # "kda" | "mla"
    step: int
    rank: int | None  # None: not rank-specific
    stage: str  # "k1" | "k2" | "untouched"
    output: str  # output or tap name (policy.STAGES)
    view: str  # "chained" | "isolated"
    metrics: dict
    criteria: list[CriterionResult]
    passed: bool
    oracle: dict | None = None  # {"fast": scalar metrics, "ref": scalar metrics} against the fp64 oracle
    noise: dict | None = None  # {metric: spread} of the perturbed reference runs
    note: str = ""

    @staticmethod
    def judged(policy, *, capture: str, layer: int, kind: str, step: int, rank, stage: str, output: str,
               view: str, fmt: str | None, metrics: dict, oracle: dict | None = None, noise=None,
               note: str = "", config: str | None = None) -> "Comparison":
        """Judge `metrics` with `policy` and wrap everything in a Comparison."""
        from .metrics import scalars
        from .policy import noise_spread

        crit = judge(policy, stage, output, fmt, metrics, oracle=oracle, noise=noise, view=view, config=config)
        orc = None if oracle is None else {k: scalars(v) for k, v in oracle.items()}
        return Comparison(capture, layer, kind, step, rank, stage, output, view, metrics, crit,
                          _all_passed(crit), orc, None if noise is None else noise_spread(noise), note)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.stage, self.output, self.view)

    def to_dict(self) -> dict:
        return {"capture": self.capture, "layer": self.layer, "kind": self.kind, "step": self.step,
                "rank": self.rank, "stage": self.stage, "output": self.output, "view": self.view,
                "passed": self.passed, "metrics": self.metrics,
                "criteria": [c.to_dict() for c in self.criteria],
                "oracle": self.oracle, "noise": self.noise, "note": self.note}

    @staticmethod
    def from_dict(d: dict) -> "Comparison":
        return Comparison(d["capture"], d["layer"], d["kind"], d["step"], d["rank"], d["stage"], d["output"],
                          d["view"], d["metrics"], [CriterionResult.from_dict(c) for c in d["criteria"]],
                          bool(d["passed"]), d.get("oracle"), d.get("noise"), d.get("note", ""))


@dataclass
class CaptureResult:
    """One capture set (one step of one layer, every rank)."""

    id: str
    fmt: str
    layer: int
    kind: str
    step: int
    world: int
    comparisons: list[Comparison] = field(default_factory=list)
    missing_taps: dict[str, list[str]] = field(default_factory=dict)  # {"k1": [...], "k2": [...]}
    timings: dict[str, float] = field(default_factory=dict)  # seconds: load, oracle, ref, backend, ...
    errors: list[str] = field(default_factory=list)  # anything that stopped a check: fails the capture
    notes: list[str] = field(default_factory=list)  # e.g. routing forced at near-ties
    aborted: str | None = None  # the harness could not finish this capture (a time limit): why

    @property
    def passed(self) -> bool:
        return not self.errors and self.aborted is None and all(c.passed for c in self.comparisons)

    @property
    def born_at(self) -> Comparison | None:
        """Where the first error was born: the earliest failing stage in dataflow order, isolated
        failures (a stage's own arithmetic) before chained ones (which may only inherit). A stage
        that fails only chained while its isolated view passes did its own work right: the error
        came from upstream, so the blame goes to the upstream comparison that spent the largest
        share of its limits (it may have passed them), when one differs at all."""
        from .policy import flow_index

        bad = [c for c in self.comparisons if not c.passed]
        if not bad:
            return None
        first = min(bad, key=lambda c: (c.view != "isolated", flow_index(c.stage, c.output), c.rank or 0))
        if first.view == "isolated":
            return first
        own = [c for c in self.comparisons if c.view == "isolated" and (c.stage, c.output) == (first.stage, first.output)]
        if not own or not all(c.passed for c in own):
            return first
        at = flow_index(first.stage, first.output)
        up = [c for c in self.comparisons if flow_index(c.stage, c.output) < at and c.stage != "untouched"
              and _differs(c)]
        return max(up, key=_used) if up else first

    @property
    def untouched(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.stage == "untouched"]

    @property
    def failed(self) -> list[Comparison]:
        return [c for c in self.comparisons if not c.passed]

    def to_dict(self) -> dict:
        return {"id": self.id, "fmt": self.fmt, "layer": self.layer, "kind": self.kind, "step": self.step,
                "world": self.world, "passed": self.passed, "missing_taps": self.missing_taps,
                "timings": self.timings, "errors": self.errors, "notes": self.notes, "aborted": self.aborted,
                "comparisons": [c.to_dict() for c in self.comparisons]}

    @staticmethod
    def from_dict(d: dict) -> "CaptureResult":
        return CaptureResult(d["id"], d["fmt"], d["layer"], d["kind"], d["step"], d["world"],
                             [Comparison.from_dict(c) for c in d["comparisons"]], d.get("missing_taps", {}),
                             d.get("timings", {}), d.get("errors", []), d.get("notes", []), d.get("aborted"))


def _differs(c: Comparison) -> bool:
    m = c.metrics or {}
    return bool(m.get("n_differ") or m.get("rel_l2") or (m.get("exact_frac", 1.0) < 1.0))


def _used(c: Comparison) -> float:
    return max((r.used for r in c.criteria if r.used is not None and not r.skipped), default=0.0)


@dataclass
class Run:
    """A whole replay: the backend, where it ran, the policy and every capture set."""

    backend: str
    device: str
    arch: str | None = None
    env: dict = field(default_factory=dict)
    policy: str = ""
    captures: list[CaptureResult] = field(default_factory=list)
    options: dict = field(default_factory=dict)  # isolate, noise seeds, captures dir, command
    started: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    duration_s: float | None = None

    @property
    def passed(self) -> bool:
        return bool(self.captures) and all(c.passed for c in self.captures)

    @property
    def comparisons(self) -> list[Comparison]:
        return [c for cap in self.captures for c in cap.comparisons]

    @property
    def complete(self) -> bool:
        """Every capture was judged to the end (none stopped by a time limit)."""
        return all(c.aborted is None for c in self.captures)

    def exit_code(self) -> int:
        from .errors import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_PASS

        if not self.complete:
            return EXIT_INCOMPLETE
        return EXIT_PASS if self.passed else EXIT_FAIL

    def summary(self) -> dict:
        comps = self.comparisons
        crits = [r for c in comps for r in c.criteria]
        return {"passed": self.passed, "captures": len(self.captures),
                "captures_failed": sum(not c.passed for c in self.captures),
                "comparisons": len(comps), "comparisons_failed": sum(not c.passed for c in comps),
                "criteria": len(crits), "criteria_failed": sum(not (r.passed or r.skipped) for r in crits),
                "criteria_skipped": sum(r.skipped for r in crits),
                "errors": sum(len(c.errors) for c in self.captures),
                "aborted": sum(c.aborted is not None for c in self.captures)}

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "backend": self.backend, "device": self.device, "arch": self.arch,
                "env": self.env, "policy": self.policy, "options": self.options, "started": self.started,
                "duration_s": self.duration_s, "summary": self.summary(),
                "captures": [c.to_dict() for c in self.captures]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(_enc(self.to_dict()), indent=indent, allow_nan=False,
                          separators=(",", ":") if indent is None else None)

    def save(self, path) -> Path:
        """Write JSON atomically (temp file + rename)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(p)
        return p

    @staticmethod
    def from_dict(d: dict, where: str = "<json>") -> "Run":
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            got = d.get("schema") if isinstance(d, dict) else type(d).__name__
            raise InputError("schema", f"not a k3verify report (schema {got!r}, expected {SCHEMA!r})", where)
        _check_report(d, where)
        d = _dec(d)
        try:
            return Run(d["backend"], d["device"], d.get("arch"), d.get("env", {}), d.get("policy", ""),
                       [CaptureResult.from_dict(c) for c in d["captures"]], d.get("options", {}),
                       d.get("started", ""), d.get("duration_s"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError("captures", f"malformed report: {type(e).__name__} {e}", where) from None

    @staticmethod
    def from_json(text: str, where: str = "<json>") -> "Run":
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise InputError("json", f"not valid JSON: {str(e)[:200]}", where) from None
        return Run.from_dict(d, where)

    @staticmethod
    def load(path) -> "Run":
        p = Path(path)
        try:
            if not p.is_file():
                raise InputError("report", "not a regular file" if p.exists() else "not found", str(p))
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise InputError("report", "not a text (JSON) file", str(p)) from None
        except OSError as e:
            raise InputError("report", f"cannot read: {e.strerror or e}", str(p)) from None
        return Run.from_json(text, str(p))


_TYPES = {"captures": list, "backend": str, "device": str}
_CAP_TYPES = {"id": str, "fmt": str, "layer": int, "kind": str, "step": int, "world": int, "comparisons": list}
_CMP_TYPES = {"capture": str, "stage": str, "output": str, "view": str, "passed": bool, "metrics": dict,
              "criteria": list}


def _check_report(d: dict, where: str) -> None:
    """Field types of a report, checked before use: a wrong one is named, never a traceback."""
    def need(obj, types, path):
        if not isinstance(obj, dict):
            raise InputError(path, f"must be an object, got {type(obj).__name__}", where)
        for k, ty in types.items():
            v = obj.get(k)
            if not isinstance(v, ty) or (ty is int and isinstance(v, bool)):
                raise InputError(f"{path}.{k}" if path else k,
                                 f"must be {ty.__name__}, got {type(v).__name__ if k in obj else 'nothing'}", where)

    need(d, _TYPES, "")
    for i, c in enumerate(d["captures"]):
        need(c, _CAP_TYPES, f"captures[{i}]")
        for j, m in enumerate(c["comparisons"]):
            need(m, _CMP_TYPES, f"captures[{i}].comparisons[{j}]")
            for k, r in enumerate(m["criteria"]):
                if not isinstance(r, dict) or not isinstance(r.get("name"), str):
                    raise InputError(f"captures[{i}].comparisons[{j}].criteria[{k}]", "must be an object with a name",
                                     where)


# Non-finite floats travel as the strings "inf", "-inf", "nan" (strict JSON has none).
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _enc(o):
    if isinstance(o, float):
        if math.isfinite(o):
            return o
        return "nan" if math.isnan(o) else ("inf" if o > 0 else "-inf")
    if isinstance(o, dict):
        return {str(k): _enc(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_enc(v) for v in o]
    return o


_FLOAT_FIELDS = {"value", "limit", "margin", "used"}


def _dec(o, in_numbers: bool = False):
    """Inverse of _enc inside metrics/oracle/noise dicts and criterion numbers."""
    if isinstance(o, str) and in_numbers and o in _NONFINITE:
        return _NONFINITE[o]
    if isinstance(o, dict):
        return {k: _dec(v, in_numbers or k in ("metrics", "oracle", "noise") or k in _FLOAT_FIELDS)
                for k, v in o.items()}
    if isinstance(o, list):
        return [_dec(v, in_numbers) for v in o]
    return o


# ---------------------------------------------------------------- environment

def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:  # noqa: BLE001 - not installed or no metadata
        return None


def git_revision(root=None) -> str:
    """HEAD commit (+"-dirty" with uncommitted changes), or "unknown"."""
    import os

    root = Path(root) if root else Path(__file__).resolve().parent.parent
    # read-only: `git status` refreshes the index under .git/index.lock unless optional locks are off
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, env=env)
        if rev.returncode:
            return "unknown"
        st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=5, env=env)
        return rev.stdout.strip() + ("-dirty" if st.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_info(device: str = "cpu") -> tuple[str, str]:
    """(device name, arch): e.g. ("NVIDIA H200", "sm_90"), ("AMD Instinct MI300X", "gfx942")."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(dev)
        arch = getattr(p, "gcnArchName", None) or f"sm_{p.major}{p.minor}"
        return p.name, arch.split(":")[0]
    return (platform.processor() or platform.machine() or "cpu"), platform.machine()


def collect_env(backend=None, device: str = "cpu") -> dict:
    """Versions and host facts for the report's environment section.

    `backend`: the backend object (its `name`/`version` are recorded) or its name."""
    import torch

    name, arch = device_info(device)
    env = {
        "k3verify": _version("k3verify") or "0+unknown",
        "git": git_revision(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "flydsl": _version("flydsl"),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "device_name": name,
        "arch": arch,
        "host": platform.node(),
        "platform": platform.platform(),
    }
    if isinstance(backend, str):
        env["backend"] = backend
    elif backend is not None:
        env["backend"] = getattr(backend, "name", None) or type(backend).__name__
        env["backend_version"] = getattr(backend, "version", None)
    return env


__all__ = ["Comparison", "CaptureResult", "Run", "collect_env", "device_info", "git_revision", "SCHEMA",
           "VIEWS"]
