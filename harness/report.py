"""Reports of a replay `harness.results.Run`: Markdown for a PR, JSON, an HTML page
with plots (`k3verify diff` of two JSON reports is harness.diff).

API (what the replay calls):

    summary_line(run) -> str                      # "**PASS** · backend `ref` · ..."
    stage_rows(run) -> list[dict]                 # the per-stage table as data
    markdown(run) -> str
    stage_table(run) -> str                       # the per-stage table alone
    html_page(run) -> str                         # plots skipped (with a note) without matplotlib
    write_markdown(run, path) / write_html(run, path) -> Path   (atomic writes)
    write_reports(run, md=None, json=None, html=None) -> list[str]
        writes the requested files and returns notes (e.g. plots skipped)
    problem_lines(run) -> list[str]               # per failing capture: where its error was born
"""
from __future__ import annotations

import base64
import html as _html
import io
import math
from collections import defaultdict
from pathlib import Path

from tabulate import tabulate

from .metrics import MAG_BINS, MAG_EDGES, ULP_BINS
from .policy import STAGE_WORDS, STAGES
from .results import Comparison, Run

STAGE_ORDER = {s: i for i, s in enumerate(STAGES)}
OUTPUT_ORDER = {(s, o): i for s in STAGES for i, o in enumerate(STAGES[s])}
TABLE_COLUMNS = ("stage", "criterion (metric)", "worst value", "reference's own", "limit", "margin", "used",
                 "worst location", "captures failing")


# ---------------------------------------------------------------- formatting

def fmt_num(v, metric: str = "") -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if metric == "cosine" and 0.99 < v < 1:
        return f"1-{1 - v:.2e}"
    if v == int(v) and abs(v) < 1e6:
        return str(int(v))
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.3g}"
    return f"{v:.4g}"


def fmt_loc(c: Comparison, metric: str = "") -> str:
    loc = c.metrics.get("worst_ulp" if metric == "max_ulp" else "worst")
    where = c.capture + ("" if c.rank is None else f" r{c.rank}")
    if not loc:
        return where
    return where + " " + " ".join(f"{k}={v}" for k, v in loc.items())


def _row_loc(c: Comparison, r) -> str:
    """Worst location of a table row; none where nothing differs (a clean exact row)."""
    if r is None or (r.value == 0 and r.name in ("exact", "finite")) or not (
            c.metrics.get("worst") or c.metrics.get("worst_ulp")):
        return "—"
    return fmt_loc(c, r.metric)


def stage_label(stage: str, output: str, view: str = "chained") -> str:
    """`k1 · in_proj (proj)`, `(isolated)` appended for that view."""
    words = STAGE_WORDS.get((stage, output), output)
    return f"{stage} · {words} ({output})" + ("" if view == "chained" else f" [{view}]")


def _key_sort(k):
    stage, output, view = k
    return (STAGE_ORDER.get(stage, 99), OUTPUT_ORDER.get((stage, output), 99), output, view != "chained", view)


def _label(stage: str, output: str, view: str) -> str:
    return f"{stage}/{output}" + ("" if view == "chained" else f" ({view})")


# Among criteria spending the same share of their budget, show the most telling one.
_PRIORITY = {"exact": 6, "routing": 5, "oracle_k": 4, "noise_m": 3, "finite": 0}


def _worst_criterion(comps: list[Comparison]):
    """(comparison, criterion) with the largest budget use; failing ones first."""
    best = None
    for c in comps:
        for r in c.criteria:
            if r.skipped:
                continue
            used = r.used if r.used is not None and not math.isnan(r.used) else math.inf
            score = (not r.passed, used, _PRIORITY.get(r.name, 2))
            if best is None or score > best[0]:
                best = (score, c, r)
    return (best[1], best[2]) if best else (comps[0], None)


def stage_rows(run: Run) -> list[dict]:
    """Per stage/output/view: the worst criterion over every capture and rank."""
    groups: dict[tuple, list[Comparison]] = defaultdict(list)
    for c in run.comparisons:
        groups[c.key].append(c)
    rows = []
    for key in sorted(groups, key=_key_sort):
        comps = groups[key]
        c, r = _worst_criterion(comps)
        caps = {x.capture for x in comps}
        failing = {x.capture for x in comps if not x.passed}
        own = None  # the reference's own error against the oracle, beside an oracle-ratio row
        if r is not None and r.name == "oracle_k" and c.oracle:
            own = c.oracle.get("ref", {}).get(r.metric)
        rows.append({"stage": key[0], "output": key[1], "view": key[2], "passed": not failing,
                     "label": stage_label(*key),
                     "criterion": r.name if r else None, "metric": r.metric if r else None,
                     "value": r.value if r else None, "ref_own": own, "limit": r.limit if r else None,
                     "margin": r.margin if r else None, "used": r.used if r else None,
                     "location": _row_loc(c, r), "captures": len(caps),
                     "captures_failing": len(failing), "comparisons": len(comps)})
    return rows


def _pct(u) -> str:
    if u is None:
        return "—"
    if math.isinf(u) or math.isnan(u):
        return "inf"
    return f"{100 * u:.0f}%" if u < 100 else f"{u:.3g}x"


def _table_cells(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        mark = "" if r["passed"] else "**FAIL** "
        crit = "—" if not r["criterion"] else f"{r['criterion']} ({r['metric']})"
        out.append([mark + r["label"], crit, fmt_num(r["value"], r["metric"] or ""),
                    fmt_num(r["ref_own"], r["metric"] or ""), fmt_num(r["limit"], r["metric"] or ""),
                    fmt_num(r["margin"]), _pct(r["used"]), r["location"],
                    f"{r['captures_failing']}/{r['captures']}"])
    return out


def summary_line(run: Run) -> str:
    s = run.summary()
    verdict = "PASS" if s["passed"] else "FAIL"
    dev = run.device + (f" ({run.arch})" if run.arch else "")
    line = (f"**{verdict}** · backend `{run.backend}` · device {dev} · {s['captures']} captures"
            f" ({s['captures_failed']} failed) · {s['comparisons']} comparisons ({s['comparisons_failed']} failed)")
    if s["errors"]:
        line += f" · {s['errors']} errors"
    if s.get("aborted"):
        line += f" · {s['aborted']} not finished"
    return line


def born_line(cap) -> str | None:
    """One line per failing capture: where its first error was born."""
    if cap.passed:
        return None
    if cap.aborted:
        return f"{cap.id}: not finished: {cap.aborted}"
    c = cap.born_at
    if c is None:
        return f"{cap.id}: {cap.errors[0] if cap.errors else 'failed'}"
    bad = next((r for r in c.criteria if not (r.passed or r.skipped)), None)
    if bad is None:  # inherited: within its own limits, but a later stage fails only chained
        bad = max((r for r in c.criteria if r.used is not None and not r.skipped), key=lambda r: r.used, default=None)
        what = "" if bad is None else f" (within its limits, {bad.used:.0%} of {bad.name}; what it passed on " \
                                      f"fails downstream, chained)"
    else:
        what = f": {bad.name} ({bad.metric}) {fmt_num(bad.value, bad.metric)} vs {fmt_num(bad.limit, bad.metric)}"
    rank = "" if c.rank is None else f" rank {c.rank}"
    err = f" (and {len(cap.errors)} error(s): {cap.errors[0]})" if cap.errors else ""
    return f"{cap.id}: born at {stage_label(c.stage, c.output, c.view)}{rank}{what}{err}"


def problem_lines(run: Run, limit: int = 20) -> list[str]:
    """What the terminal shows under the table: each failing capture's birth place and errors."""
    bad = [c for c in run.captures if not c.passed]
    lines = [born_line(c) for c in bad[:limit]]
    for c in bad[:limit]:
        lines += [f"  {c.id}: error: {e}" for e in c.errors[1:4]]
    if len(bad) > limit:
        lines.append(f"... and {len(bad) - limit} more failing captures (see the reports)")
    return lines


def _missing_taps(run: Run) -> dict[str, list[str]]:
    out: dict[str, set] = defaultdict(set)
    for cap in run.captures:
        for stage, taps in cap.missing_taps.items():
            out[stage].update(taps)
    return {k: sorted(v) for k, v in sorted(out.items())}


def _env_rows(run: Run) -> list[list[str]]:
    rows = [["backend", run.backend], ["device", run.device], ["arch", run.arch or "—"],
            ["policy", run.policy or "—"]]
    shown = {"backend": run.backend, "arch": run.arch}
    rows += [[k, "—" if v is None else str(v)] for k, v in run.env.items() if not (k in shown and v == shown[k])]
    for k, v in run.options.items():
        rows.append([f"option {k}", str(v)])
    rows.append(["started", run.started])
    if run.duration_s is not None:
        rows.append(["duration", f"{run.duration_s:.2f} s"])
    return rows


def _cap_head(cap) -> str:
    return (f"<code>{_html.escape(cap.id)}</code> — {cap.fmt}, layer {cap.layer} ({cap.kind}), step {cap.step},"
            f" world {cap.world}: {len(cap.comparisons)} comparisons, {len(cap.failed)} failed")


def _cap_notes(cap) -> list[str]:
    born = born_line(cap)
    lines = ([f"- **{born}**"] if born else []) + ([f"- not finished: {cap.aborted}"] if cap.aborted else [])
    lines += [f"- error: {e}" for e in cap.errors] + [f"- {n}" for n in cap.notes]
    miss = [f"{s}: {', '.join(t)}" for s, t in cap.missing_taps.items() if t]
    if miss:
        lines.append(f"- taps not exposed by the backend: {'; '.join(miss)}")
    if cap.timings:
        lines.append("- timings: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in cap.timings.items()))
    return lines


def _failing_details(cap) -> str:
    """One folded block per failing capture: its failing comparisons and criteria."""
    lines = [f"<details><summary>FAIL {_cap_head(cap)}</summary>\n"] + _cap_notes(cap)
    rows = []
    for c in sorted(cap.failed, key=lambda c: (_key_sort(c.key), c.rank or 0)):
        crit = "; ".join(f"{r.name} {fmt_num(r.value, r.metric)} vs {fmt_num(r.limit, r.metric)}"
                         + (f" ({r.note})" if r.note else "") for r in c.criteria if not (r.passed or r.skipped))
        m = c.metrics
        rows.append([stage_label(c.stage, c.output, c.view), "—" if c.rank is None else c.rank, fmt_num(m.get("rel_l2")),
                     fmt_num(m.get("max_ulp")), fmt_loc(c).removeprefix(c.capture).strip(), crit])
    if rows:
        lines += ["", tabulate(rows, headers=["stage/output", "rank", "rel L2", "max ulp", "worst at",
                                              "failed criteria"], tablefmt="github")]
    lines.append("\n</details>\n")
    return "\n".join(lines)


def _passing_details(caps) -> str:
    """One folded block listing every passing capture with its tightest criterion."""
    rows = []
    for cap in caps:
        c, r = _worst_criterion(cap.comparisons) if cap.comparisons else (None, None)
        tight = "—" if r is None else f"{stage_label(c.stage, c.output, c.view)} {r.name} {_pct(r.used)}"
        rows.append([f"`{cap.id}`", cap.fmt, cap.layer, cap.kind, cap.step, len(cap.comparisons), tight,
                     f"{sum(cap.timings.values()) * 1e3:.0f} ms" if cap.timings else "—"])
    table = tabulate(rows, headers=["capture", "fmt", "layer", "kind", "step", "comparisons", "tightest",
                                    "time"], tablefmt="github")
    return f"<details><summary>{len(caps)} passing captures</summary>\n\n{table}\n\n</details>\n"


# A PR comment holds 65536 characters; failing-capture blocks beyond this budget are
# left to the JSON report.
MD_BUDGET = 60000


def markdown(run: Run) -> str:
    """The PR report: summary line, per-stage table, folded per-capture details, environment."""
    parts = [f"## k3verify replay\n\n{summary_line(run)}\n"]
    rows = stage_rows(run)
    if rows:
        parts.append(tabulate(_table_cells(rows), headers=list(TABLE_COLUMNS), tablefmt="github"))
        parts.append("\n`margin` >= 0 passes; `used` = share of the error budget the worst case spends.\n")
    else:
        parts.append("_no comparisons_\n")
    miss = _missing_taps(run)
    if any(miss.values()):
        parts.append("Taps the backend does not expose (stages judged only through later outputs): "
                     + "; ".join(f"{s}: {', '.join(t)}" for s, t in miss.items() if t) + "\n")
    born = [born_line(c) for c in run.captures if not c.passed]
    if born:
        parts.append("### Where the errors were born\n\n" + "\n".join(f"- {b}" for b in born[:50]) + "\n")
    errs = [(cap.id, e) for cap in run.captures for e in cap.errors]
    if errs:
        parts.append("### Errors\n\n" + "\n".join(f"- `{i}`: {e}" for i, e in errs[:50]) + "\n")
    env = "### Environment\n\n" + tabulate(_env_rows(run), headers=["", ""], tablefmt="github") + "\n"
    if run.captures:
        parts.append("### Captures\n")
        failing = sorted((c for c in run.captures if not c.passed), key=lambda c: c.id)
        passing = sorted((c for c in run.captures if c.passed), key=lambda c: c.id)
        used = sum(map(len, parts)) + len(env)
        blocks = [_passing_details(passing)] if passing else []
        used += sum(map(len, blocks))
        shown = 0
        for cap in failing:
            b = _failing_details(cap)
            if used + len(b) > MD_BUDGET:
                break
            parts.append(b)
            used += len(b)
            shown += 1
        if shown < len(failing):
            parts.append(f"_{len(failing) - shown} more failing captures: see the JSON report._\n")
        parts.extend(blocks)
    parts.append(env)
    return "\n".join(parts)


# ---------------------------------------------------------------- HTML + plots

def _have_mpl() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _finish(ax, fig, empty_text: str):
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, empty_text, ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    return fig


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.subplots_adjust(left=0.08, right=0.98, top=0.9, bottom=0.28)
    fig.savefig(buf, format="png", dpi=80)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _by_stage(run: Run, view: str = "chained") -> dict[str, dict[str, list[Comparison]]]:
    out: dict[str, dict[str, list[Comparison]]] = defaultdict(lambda: defaultdict(list))
    for c in run.comparisons:
        if c.view == view and c.stage != "untouched":
            out[c.stage][c.output].append(c)
    return {s: dict(sorted(v.items(), key=lambda kv: OUTPUT_ORDER.get((s, kv[0]), 99)))
            for s, v in sorted(out.items(), key=lambda kv: STAGE_ORDER.get(kv[0], 99))}


def _axes():
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6))
    ax = fig.subplots()
    ax.set_prop_cycle(color=colormaps["tab20"].colors)  # up to 13 outputs per stage
    return fig, ax


def _plot_hist(stage: str, outs: dict[str, list[Comparison]]):
    fig, ax = _axes()
    x = list(range(len(ULP_BINS)))
    for name, comps in outs.items():
        counts = [0] * len(ULP_BINS)
        for c in comps:
            for i, v in enumerate(c.metrics.get("ulp_hist") or []):
                counts[i] += v
        tot = sum(counts)
        if tot:
            ax.plot(x, [v / tot if v else math.nan for v in counts], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xticks(x, ULP_BINS, rotation=45)
    ax.set_xlabel("per-element error, bf16 ulps of the reference")
    ax.set_ylabel("fraction of elements")
    ax.set_title(f"{stage}: error histogram (chained, all captures and ranks)")
    return _finish(ax, fig, "no data")


def _plot_mag(stage: str, outs: dict[str, list[Comparison]]):
    fig, ax = _axes()
    # bin 0 is |b| == 0 (no position on a log axis); bin i>=1 sits at its upper edge
    centers = [MAG_EDGES[i - 1] if i - 1 < len(MAG_EDGES) else MAG_EDGES[-1] * 10 for i in range(1, len(MAG_BINS))]
    for name, comps in outs.items():
        mx = [0.0] * len(MAG_BINS)
        for c in comps:
            me = c.metrics.get("mag_err") or {}
            for i, (n, v) in enumerate(zip(me.get("count", []), me.get("max_abs", []))):
                if n:
                    mx[i] = max(mx[i], v)
        pts = [(x, y) for x, y in zip(centers, mx[1:]) if y > 0]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.plot(centers, [x * 2.0 ** -8 for x in centers], "k--", lw=0.8, label="half bf16 ulp")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|reference| (bin upper edge)")
    ax.set_ylabel("max |candidate - reference|")
    ax.set_title(f"{stage}: error vs magnitude")
    return _finish(ax, fig, "no error anywhere")


def _plot_drift(stage: str, outs: dict[str, list[Comparison]]):
    fig, ax = _axes()
    for name, comps in outs.items():
        per_step: dict[int, float] = {}
        for c in comps:
            v = c.metrics.get("rel_l2")
            if isinstance(v, (int, float)) and math.isfinite(v):
                per_step[c.step] = max(per_step.get(c.step, 0.0), v)
        pts = sorted((s, v) for s, v in per_step.items() if v > 0)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("decode step")
    ax.set_ylabel("rel L2 (max over layers, ranks)")
    ax.set_title(f"{stage}: drift over steps (chained)")
    return _finish(ax, fig, "no error anywhere")


_CSS = ("body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;font-size:90%}"
        "td,th{border:1px solid #ccc;padding:2px 6px}th{background:#eee}.fail{color:#b00;font-weight:bold}"
        "img{max-width:100%;display:block;margin:1em 0}")


def html_page(run: Run) -> str:
    """A standalone HTML page with embedded PNG plots (a note instead when matplotlib is missing)."""
    s = summary_line(run).replace("**", "")
    verdict_cls = "" if run.passed else " class='fail'"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>k3verify report</title>"
             f"<style>{_CSS}</style></head><body><h1>k3verify replay</h1><p{verdict_cls}>{_html.escape(s)}</p>"]
    rows = stage_rows(run)
    if rows:
        cells = [[_html.escape(str(v)) for v in r] for r in _table_cells(rows)]
        cells = [[v.replace("**FAIL**", "<span class='fail'>FAIL</span>") for v in r] for r in cells]
        parts.append(tabulate(cells, headers=list(TABLE_COLUMNS), tablefmt="unsafehtml"))
    if not _have_mpl():
        parts.append(f"<p class='note'>{_html.escape(NO_MPL_NOTE)}</p>")
    else:
        for stage, outs in _by_stage(run).items():
            parts.append(f"<h2>{_html.escape(stage)}</h2>")
            for title, plot in (("error histogram", _plot_hist), ("error vs magnitude", _plot_mag),
                                ("drift over steps", _plot_drift)):
                fig = plot(stage, outs)
                parts.append(f"<img alt='{_html.escape(stage)} {title}' src='data:image/png;base64,{_png(fig)}'>")
    parts.append("<h2>Environment</h2>" + tabulate([[_html.escape(a), _html.escape(b)] for a, b in _env_rows(run)],
                                                  tablefmt="unsafehtml"))
    parts.append("</body></html>")
    return "\n".join(parts)


NO_MPL_NOTE = "plots skipped: matplotlib is not installed (pip install matplotlib)"


def _write(path, text: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(p)


def stage_table(run: Run) -> str:
    """The per-stage table alone (github Markdown), e.g. for the terminal."""
    rows = stage_rows(run)
    return tabulate(_table_cells(rows), headers=list(TABLE_COLUMNS), tablefmt="github") if rows else ""


def write_markdown(run: Run, path) -> Path:
    _write(path, markdown(run))
    return Path(path)


def write_html(run: Run, path) -> Path:
    _write(path, html_page(run))
    return Path(path)


def write_reports(run: Run, md=None, json=None, html=None) -> list[str]:
    """Write the requested reports (paths or None); returns notes (e.g. plots skipped)."""
    notes = []
    if md:
        write_markdown(run, md)
    if json:
        run.save(json)
    if html:
        write_html(run, html)
        if not _have_mpl():
            notes.append(f"{html}: {NO_MPL_NOTE}")
    return notes


__all__ = ["summary_line", "stage_rows", "stage_table", "markdown", "html_page", "write_markdown", "write_html",
           "write_reports", "problem_lines", "born_line", "stage_label", "TABLE_COLUMNS", "fmt_num"]
