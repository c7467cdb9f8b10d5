"""`k3verify diff A.json B.json`: did a change make the numerics worse? A is the baseline, B
the candidate (two replays of the same captures).

A regression is judged against the policy's limits, not against noise:

- a criterion that passed in A fails in B (the same capture, rank, stage, output, view);
- a criterion's used share of its error budget (`used`: value / limit) grows by more than
  `--margin` (default 0.25, i.e. a quarter of the budget) on any capture;
- a comparison A made that B no longer makes, a capture missing from B, more capture errors
  or unfinished captures in B.

Improvements, and changes within the margin, are not regressions. The table shows, per stage,
output and view, the worst used share in A and in B and the change.

Exit 0: no regression; 1: a regression beyond the margin; 2: bad input.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tabulate import tabulate

from .errors import ArgParser, InputError
from .results import Comparison, Run

DEFAULT_MARGIN = 0.25


@dataclass
class Diff:
    rows: list[dict] = field(default_factory=list)  # per stage/output/view: base, new (worst used), delta, worse
    regressions: list[str] = field(default_factory=list)  # one line per thing that got worse
    notes: list[str] = field(default_factory=list)

    @property
    def worse(self) -> bool:
        return bool(self.regressions)


def _used(r) -> float:
    if r.skipped or r.used is None:
        return math.nan
    return math.inf if math.isnan(r.used) else float(r.used)


def _ckey(c: Comparison) -> tuple:
    return (c.capture, c.rank, c.stage, c.output, c.view)


def _skey(k) -> tuple:
    from .policy import flow_index

    return (flow_index(k[0], k[1]), k[2] != "chained", k)


def diff_runs(base: Run, new: Run, margin: float = DEFAULT_MARGIN) -> Diff:
    from .report import stage_label

    d = Diff()
    ids_a, ids_b = {c.id for c in base.captures}, {c.id for c in new.captures}
    common = ids_a & ids_b
    if not common:
        raise InputError("captures", "the two reports share no capture id: they replayed different captures")
    for cid in sorted(ids_a - ids_b):
        d.regressions.append(f"capture {cid}: missing in the new report")
    if ids_b - ids_a:
        d.notes.append(f"captures only in the new report (not compared): {', '.join(sorted(ids_b - ids_a))}")
    ca = {_ckey(c): c for c in base.comparisons if c.capture in common}
    cb = {_ckey(c): c for c in new.comparisons if c.capture in common}
    worst: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for k, a in ca.items():
        skey = k[2:]
        label = f"{stage_label(*skey)} {k[0]}" + ("" if k[1] is None else f" r{k[1]}")
        b = cb.get(k)
        if b is None:
            d.regressions.append(f"{label}: no longer compared")
            continue
        rb = {r.name: r for r in b.criteria}
        for r in a.criteria:
            s = rb.get(r.name)
            if s is None:
                d.regressions.append(f"{label}: criterion {r.name} no longer applied")
                continue
            ua, ub = _used(r), _used(s)
            w = worst[skey]
            if not math.isnan(ua):
                w[0] = max(w[0], ua)
            if not math.isnan(ub):
                w[1] = max(w[1], ub)
            if (r.passed or r.skipped) and not (s.passed or s.skipped):
                d.regressions.append(f"{label}: {r.name} ({r.metric}) now fails: {_f(r.value)} -> {_f(s.value)} "
                                     f"(limit {_f(s.limit)})")
            elif not math.isnan(ua) and not math.isnan(ub) and ub - ua > margin:
                d.regressions.append(f"{label}: {r.name} ({r.metric}) uses {_pct(ua)} -> {_pct(ub)} of its budget "
                                     f"({_f(r.value)} -> {_f(s.value)}, limit {_f(s.limit)})")
    for k in sorted(set(cb) - set(ca)):
        worst.setdefault(k[2:], [0.0, 0.0])
    for skey in sorted(worst, key=_skey):
        ua, ub = worst[skey]
        dl = ub - ua if math.isfinite(ua) and math.isfinite(ub) else math.nan
        d.rows.append({"stage": skey[0], "output": skey[1], "view": skey[2], "base": ua, "new": ub, "delta": dl,
                       "worse": (dl > margin) if not math.isnan(dl) else (math.isinf(ub) and not math.isinf(ua))})
    for what, get in (("capture errors", lambda c: len(c.errors)), ("unfinished captures", lambda c: c.aborted is not None)):
        ea = sum(get(c) for c in base.captures if c.id in common)
        eb = sum(get(c) for c in new.captures if c.id in common)
        if eb > ea:
            d.regressions.append(f"{what}: {ea} -> {eb}")
    return d


def _f(v) -> str:
    from .report import fmt_num

    return fmt_num(v)


def _pct(u: float) -> str:
    return "inf" if math.isinf(u) else f"{100 * u:.0f}%"


def diff_table(d: Diff, show_all: bool = False) -> str:
    from .report import stage_label

    rows = [[stage_label(r["stage"], r["output"], r["view"]), _pct(r["base"]), _pct(r["new"]),
             "—" if math.isnan(r["delta"]) else f"{100 * r['delta']:+.0f} pts",
             "WORSE" if r["worse"] else ("better" if r["delta"] < 0 else "")]
            for r in d.rows if show_all or r["worse"] or (not math.isnan(r["delta"]) and r["delta"] != 0)]
    if not rows:
        return ""
    return tabulate(rows, headers=["stage", "worst budget used (A)", "(B)", "change", ""], tablefmt="github")


def cli(argv) -> int:
    ap = ArgParser(prog="k3verify diff", description=__doc__.split("\n\n")[0],
                   epilog="exit codes: 0 no regression, 1 a regression beyond the margin, 2 bad input")
    ap.add_argument("a", metavar="A.json", help="the baseline report")
    ap.add_argument("b", metavar="B.json", help="the candidate report")
    ap.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                    help="growth of a criterion's used budget share tolerated (default 0.25 = a quarter)")
    ap.add_argument("--all", action="store_true", help="list every stage, not only what changed")
    ap.add_argument("--md", help="also write the diff as Markdown to this file")
    ns = ap.parse_args(argv)
    if not (ns.margin >= 0 and math.isfinite(ns.margin)):
        raise InputError("--margin", f"must be a finite number >= 0, got {ns.margin}")
    if ns.md:
        from .replay import check_outputs

        check_outputs(md=ns.md)
    base, new = Run.load(ns.a), Run.load(ns.b)
    d = diff_runs(base, new, ns.margin)
    verdict = (f"WORSE: {len(d.regressions)} regression(s)" if d.worse else "no regression") + \
        f" (A {ns.a}: {base.backend}, B {ns.b}: {new.backend}, margin {ns.margin:g} of each budget)"
    lines = [verdict, "", diff_table(d, ns.all), ""] + [f"- {r}" for r in d.regressions[:200]] + \
        [f"- note: {n}" for n in d.notes]
    text = "\n".join(lines).rstrip()
    from .replay import _print

    _print(text)
    if ns.md:
        Path(ns.md).write_text(text + "\n")
    return 1 if d.worse else 0


__all__ = ["diff_runs", "diff_table", "Diff", "cli", "DEFAULT_MARGIN"]
