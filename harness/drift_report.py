"""Reports of a `harness.drift.DriftRun`: Markdown, JSON and an HTML page with the drift plots
(distance from the oracle over steps, per layer and tensor, backend and reference side by side,
with the policy's limit).

    summary_line(run) -> str
    rows(run) -> list[dict]              # the per (layer, tensor) table as data
    table(run) -> str                    # github Markdown
    markdown(run) / html_page(run) -> str
    write_reports(run, md=None, json_path=None, html=None) -> list[str]
"""
from __future__ import annotations

import html as _html
import json
import math
from collections import Counter

from tabulate import tabulate

from . import drift_policy as dp
from .drift import DriftRun, stage_of
from .report import NO_MPL_NOTE, _CSS, _have_mpl, _write, fmt_num

COLUMNS = ("layer", "tensor (stage)", "max d(backend, oracle)", "max d(ref, oracle)", "max d(backend, ref)",
           "worst used", "at step", "NaN/Inf (b/r/o)")


def summary_line(run: DriftRun) -> str:
    verdict = "PASS" if run.passed else "FAIL"
    per = f"{run.seconds / run.steps_run * 1e3:.1f} ms/step" if run.steps_run else "—"
    line = (f"**{verdict}** · backend `{run.backend}` · {run.config} layers {run.layers[0]}-{run.layers[-1]} · "
            f"{run.steps_run}/{run.steps} steps · L = {run.num_spec + 1}, R = {run.requests} · {run.experts} · "
            f"accept {run.accept} · {'chain (not judged by ratio)' if run.chain else 'coupled'} · device {run.device} · {per}")
    if run.failures:
        line += f"\n\nborn at: {run.failures[0].line()}"
    return line


def _used(bo, ro) -> float | None:
    if bo is None or ro is None:
        return None
    lim = dp.limit("", ro)
    return math.inf if not math.isfinite(bo) else bo / lim


def rows(run: DriftRun) -> list[dict]:
    out = []
    for (layer, tensor), ser in sorted(run.series.items()):
        used = [_used(b, r) for b, r in zip(ser["bo"], ser["ro"])]
        idx = [i for i, u in enumerate(used) if u is not None]
        worst = max(idx, key=lambda i: used[i]) if idx else None
        mx = lambda xs: max((x for x in xs if x is not None), default=None)  # noqa: E731
        nan = [sum(v[c] for v in ser["nan"] if v) + sum(v[c] for v in ser["inf"] if v) for c in range(3)]
        out.append({"layer": layer, "kind": run.kinds[layer], "tensor": tensor,
                    "stage": stage_of(tensor, run.kinds[layer]), "bo_max": mx(ser["bo"]), "ro_max": mx(ser["ro"]),
                    "br_max": mx(ser["br"]), "used_max": None if worst is None else used[worst],
                    "worst_step": worst, "nonfinite": nan})
    return out


def _cells(rs) -> list[list[str]]:
    return [[f"{r['layer']} ({r['kind']})", f"{r['tensor']} ({r['stage']})", fmt_num(r["bo_max"]),
             fmt_num(r["ro_max"]), fmt_num(r["br_max"]),
             "—" if r["used_max"] is None else ("inf" if math.isinf(r["used_max"]) else f"{100 * r['used_max']:.0f}%"),
             "—" if r["worst_step"] is None else str(r["worst_step"]), "/".join(str(x) for x in r["nonfinite"])]
            for r in rs]


def table(run: DriftRun) -> str:
    rs = rows(run)
    return tabulate(_cells(rs), headers=list(COLUMNS), tablefmt="github") if rs else "_nothing measured_"


def _routing_lines(run: DriftRun) -> list[str]:
    out = []
    for layer, rt in sorted(run.routing.items()):
        mn = {p: min((x for x in rt[p] if x is not None), default=None) for p in ("br", "ro", "bo")}
        out.append(f"- layer {layer}: lowest agreement backend–ref {fmt_num(mn['br'])}, ref–oracle "
                   f"{fmt_num(mn['ro'])}, backend–oracle {fmt_num(mn['bo'])}; tokens re-run at a near-tie "
                   f"{sum(rt['forced'])}")
    return out


def _mix_line(run: DriftRun) -> str:
    acc = Counter(a for m in run.mix for r, a in enumerate(m["num_acc"]) if r in m["live"])
    ev = Counter(e.split()[0] for m in run.mix for e in m["events"])
    idle = sum(len(m["num_acc"]) - len(m["live"]) for m in run.mix)
    return (f"request mix: {ev.get('join', 0)} joins, {ev.get('leave', 0)} leaves, {idle} padding row-steps; "
            f"acceptance counts " + ", ".join(f"a={a}: {n}" for a, n in sorted(acc.items())))


def markdown(run: DriftRun) -> str:
    parts = [f"## k3verify drift\n\n{summary_line(run)}\n",
             f"Policy: d(backend, oracle) ≤ {run.k:g} · d(ref, oracle) + {run.floor:g} (rel L2, live rows and "
             f"slots), NaN/Inf never, `out` bit-identical on every rank, padding rows of `core_out` 0, routing "
             f"differences only at near-ties (tie_eps {run.tie_eps:g}). `worst used` = largest share of that "
             f"limit a step spent.\n", table(run), ""]
    if run.failures:
        parts.append("### Failures at the first failing step\n")
        parts += [f"- {f.line()}" for f in run.failures]
        parts.append("")
    if run.routing:
        parts.append("### Routing\n")
        parts += _routing_lines(run) + [""]
    parts.append(_mix_line(run) + "\n")
    parts += [f"- note: {n}" for n in run.notes]
    env = [["setup", f"{run.setup_seconds:.1f} s"], ["steps", f"{run.seconds:.1f} s"]]
    env += [[k, "—" if v is None else str(v)] for k, v in run.env.items()]
    parts.append("\n### Environment\n\n" + tabulate(env, headers=["", ""], tablefmt="github") + "\n")
    return "\n".join(parts)


def _plot_layer(run: DriftRun, layer: int):
    from matplotlib.figure import Figure

    tensors = [t for (i, t) in sorted(run.series) if i == layer]
    fig = Figure(figsize=(10, 2.4 * len(tensors) + 0.6))
    axes = fig.subplots(len(tensors), 1, squeeze=False)[:, 0]
    for ax, tensor in zip(axes, tensors):
        ser = run.series[(layer, tensor)]
        steps = range(len(ser["bo"]))
        for key, label, style in (("bo", f"backend `{run.backend}` vs oracle", "-"),
                                  ("ro", "reference vs oracle", "-"), ("br", "backend vs reference", ":")):
            pts = [(s, v) for s, v in zip(steps, ser[key]) if v is not None and v > 0 and math.isfinite(v)]
            if pts:
                ax.plot(*zip(*pts), style, lw=1, label=label)
        lim = [(s, dp.limit(tensor, v)) for s, v in zip(steps, ser["ro"]) if v is not None]
        if lim:
            ax.plot(*zip(*lim), "k--", lw=0.7, label=f"limit {run.k:g}·ref + {run.floor:g}")
        ax.set_yscale("log")
        ax.set_title(f"layer {layer} ({run.kinds[layer]}): {tensor} — {stage_of(tensor, run.kinds[layer])}",
                     fontsize=9)
        ax.set_ylabel("rel L2")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[-1].set_xlabel("decode step")
    fig.subplots_adjust(hspace=0.6)
    return fig


def _png(fig) -> str:
    import base64
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _plain(o):
    """JSON-safe: non-finite floats as the strings "nan", "inf", "-inf" (strict JSON has none)."""
    if isinstance(o, float) and not math.isfinite(o):
        return "nan" if math.isnan(o) else ("inf" if o > 0 else "-inf")
    if isinstance(o, dict):
        return {str(k): _plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_plain(v) for v in o]
    return o


def html_page(run: DriftRun) -> str:
    s = summary_line(run).replace("**", "")
    cls = "" if run.passed else " class='fail'"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>k3verify drift</title><style>{_CSS}</style>"
             f"</head><body><h1>k3verify drift</h1><p{cls}>{_html.escape(s)}</p>",
             tabulate([[_html.escape(c) for c in r] for r in _cells(rows(run))], headers=list(COLUMNS),
                      tablefmt="unsafehtml")]
    if run.failures:
        parts.append("<ul>" + "".join(f"<li class='fail'>{_html.escape(f.line())}</li>" for f in run.failures)
                     + "</ul>")
    if not _have_mpl():
        parts.append(f"<p>{_html.escape(NO_MPL_NOTE)}</p>")
    else:
        for layer in run.layers:
            fig = _plot_layer(run, layer)
            parts.append(f"<h2>layer {layer}</h2><img alt='drift of layer {layer}' "
                         f"src='data:image/png;base64,{_png(fig)}'>")
    parts.append(f"<p>{_html.escape(_mix_line(run))}</p></body></html>")
    return "\n".join(parts)


def write_reports(run: DriftRun, md=None, json_path=None, html=None) -> list[str]:
    """Write the requested files (atomically); returns one line per file and notes."""
    lines = []
    if md:
        _write(md, markdown(run))
        lines.append(f"wrote {md}")
    if json_path:
        _write(json_path, json.dumps(_plain(run.to_json()), indent=1, sort_keys=True, allow_nan=False) + "\n")
        lines.append(f"wrote {json_path}")
    if html:
        _write(html, html_page(run))
        lines.append(f"wrote {html}")
        if not _have_mpl():
            lines.append(f"{html}: {NO_MPL_NOTE}")
    return lines
