"""`k3verify policy derive CAPTURES`: the chained limits of the tolerance policy, measured.

For every capture set the reference is replayed against itself under N `perturb` seeds (split-K
chunk order of every GEMM, the chunk order of every other fp32 reduction, the expert order —
what a correct fused kernel may legitimately change) and against the float64 oracle. Per
config preset, expert format, stage output and view it keeps the largest spread:

- chained rel L2, |gain| (scale_err) and mismatch fraction of a perturbed reference against
  the reference, and of the reference against the oracle;
- isolated rel L2 of fp32 outputs (each stage fed identical inputs: accumulation order only);
- the largest |key_ref − key_oracle| of the router keys (the tie window).

A correct kernel differs from the reference the way a reference with other reduction orders
does, so a chained limit is

    limit = max(NOISE_M × perturb spread, FLOOR[metric])

NOISE_M covers orders further from the reference's than four seeds sample; the floors are
what one bf16 rounding moved in a small share of elements gives (rel L2 2^-12, gain 2^-14,
mismatch 2^-10) where no seed moved a bit. The reference's distance from the oracle is
recorded beside (the oracle-ratio criterion judges it). Isolated fp32 outputs: NOISE_M × spread,
floored at FP32_FLOOR. The tie window cap: TIE_M × the largest key error (the backend may sit
as far on the other side); per token the routing rule narrows it to TIE_M × the reference's
own key error at the experts involved. Every limit is written with its measurement (`why`).

    k3verify policy derive golden/ [--seeds 4] [--out derived.toml]
    k3verify policy derive golden/ --update golden/tolerances.toml    # rewrite the derived block
    k3verify policy derive golden/ --check golden/tolerances.toml     # exit 1 if the file is looser

Measurements of captures too large for this machine are made where they fit and kept:
`--save M.json` writes this run's measurement (with its command and machine); `--include
M.json` adds a kept one (golden/derived/*.json: k3-tp8 from the H200) to the block written.
"""
from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path

import ref
from fast.ref_backend import RefBackend

from .errors import ArgParser, InputError

NOISE_M = 4.0  # a correct kernel's spread against the reference: up to 4x a perturbed reference's
FLOOR = {"rel_l2": 2.0 ** -12, "scale_err": 2.0 ** -14, "mismatch_frac": 2.0 ** -10}
from .metrics import TIE_M  # noqa: E402 - one constant for the cap and the per-token window
FP32_FLOOR = 2.0 ** -18  # isolated fp32 outputs: 16 fp32 ulps, a few transcendentals at CUDA's 2-ulp accuracy
CHECK_SLACK = 1.5  # --check: the file may be at most this much looser than this run's derivation
# (the spread moves with the CPU's BLAS code path and thread count)
BLOCK_BEGIN = "# >>> derived by `k3verify policy derive` (do not edit by hand: re-run it)"
BLOCK_END = "# <<< derived"
CHAINED_METRICS = {"rel_l2": "rel_l2_max", "scale_err": "scale_err_max", "mismatch_frac": "mismatch_max"}
ISO_FP32 = {("k1", "gate"), ("k1", "beta"), ("k1", "rstate"), ("k2", "logits"), ("k2", "topk_w")}
SKIP = {("k2", "topk_ids"), ("k2", "out_ranks"), ("k1", "core_pad")}


class PerturbedRef(RefBackend):
    """The reference with its reduction orders permuted by `seed` (`perturb`: the split-K chunk
    order of every GEMM and the chunk order of every other fp32 reduction): a correct kernel's
    stand-in, for the policy derivation and drift's benign reorderings."""

    def __init__(self, seed: int):
        self.seed = seed
        self.name = f"ref-perturb{seed}"

    def kda_pre(self, key, **a):
        ref.kda_pre(key, **a, perturb=self.seed)

    def k2_launch(self, key, **a):
        ref.k2_launch(key, **a, perturb=self.seed)


def measure(captures, seeds: int = 4, device: str = "cpu", progress: bool = True) -> dict:
    """{(config, fmt): {"stats": {(stage, output, view): {metric: worst}}, "sets": n, "key_err": x}}."""
    import torch

    from .capture import discover, load_set
    from .engine import run_step
    from .metrics import Batch
    from .policy import load_policy
    from .replay import corpus_order, retire_layers, step_from_set

    policy = load_policy()
    paths = corpus_order(discover(captures))
    if not paths:
        raise InputError("captures", f"no capture sets under {captures}")
    out: dict = defaultdict(lambda: {"stats": defaultdict(dict), "sets": 0, "key_err": 0.0})
    from tqdm import tqdm

    for path in retire_layers(tqdm(paths, desc="policy derive", unit="set", file=sys.stderr, disable=not progress,
                                   leave=False)):
        cs = load_set(path, device=device)
        g = out[(cs.config_name or "?", cs.fmt)]
        g["sets"] += 1
        step = step_from_set(cs, device)
        for s in range(1, seeds + 1):
            sr = run_step(step, PerturbedRef(s), isolate=True, seed=s, tie_eps=math.inf, timeout=None)
            todo, batch = [], Batch()
            for p in sr.pairs:
                key = (p.stage, p.name)
                if p.exact or p.stage == "untouched" or key in SKIP or not p.cand.is_floating_point():
                    continue
                kw = policy.compare_kw(p.stage, p.name, cs.fmt, p.view, cs.config_name)
                todo.append((p, batch.add(p.cand, p.ref, p.dims, detail=False, **kw),
                             None if p.oracle is None or p.view != "chained" or s > 1 else
                             batch.add(p.ref, p.oracle, p.dims, detail=False, **kw)))
            got = batch.run()
            for p, spread, orc in todo:
                st = g["stats"][(p.stage, p.name, p.view)]
                m = got[spread]
                _worst(st, "spread_rel_l2", m["rel_l2"])
                _worst(st, "spread_scale_err", abs(m["scale_err"]))
                _worst(st, "spread_mismatch_frac", m["mismatch_frac"])
                st["min_exact_frac"] = min(st.get("min_exact_frac", 1.0), m["exact_frac"])
                if orc is not None:
                    o = got[orc]
                    _worst(st, "oracle_rel_l2", o["rel_l2"])
                    _worst(st, "oracle_scale_err", abs(o["scale_err"]))
                    _worst(st, "oracle_mismatch_frac", o["mismatch_frac"])
            if s == 1 and cs.has_k2:  # the router keys of the reference around the oracle's
                t_ref = [{} for _ in cs.ranks]
                t_orc = [{} for _ in cs.ranks]
                _keys(cs, step, t_ref, t_orc)
                for r in cs.ranks:
                    bias = step.k2[r]["bias"].double()
                    kr = torch.sigmoid(t_ref[r]["logits"].double()) + bias
                    ko = torch.sigmoid(t_orc[r]["logits"]) + bias
                    g["key_err"] = max(g["key_err"], float((kr - ko).abs().max()))
    return {k: {"stats": dict(v["stats"]), "sets": v["sets"], "key_err": v["key_err"], "seeds": seeds}
            for k, v in out.items()}


def save_measure(meas: dict, source: str, path: Path) -> None:
    import json
    import platform

    import torch

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()
    rows = [{"config": c, "format": f, "sets": g["sets"], "seeds": g["seeds"], "key_err": g["key_err"],
             "source": f"{source} on {dev}",
             "stats": [{"stage": k[0], "output": k[1], "view": k[2], **v} for k, v in sorted(g["stats"].items())]}
            for (c, f), g in sorted(meas.items())]
    path.write_text(json.dumps({"format": "k3verify-derive-measure", "version": 1, "groups": rows}, indent=1))


def load_measure(path: Path) -> dict:
    """A kept measurement -> measure()'s shape, each group with its "source"."""
    import json

    where = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise InputError("--include", f"cannot read a measurement: {e}", where) from None
    if not isinstance(doc, dict) or doc.get("format") != "k3verify-derive-measure" or doc.get("version") != 1:
        raise InputError("format", "not a k3verify-derive-measure v1 file", where)
    out = {}
    try:
        for g in doc["groups"]:
            stats = {}
            for st in g["stats"]:
                st = dict(st)
                key = (str(st.pop("stage")), str(st.pop("output")), str(st.pop("view")))
                stats[key] = {k: float(v) for k, v in st.items()}
            out[(str(g["config"]), str(g["format"]))] = {"stats": stats, "sets": int(g["sets"]),
                                                         "seeds": int(g["seeds"]), "key_err": float(g["key_err"]), "source": str(g["source"])}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError("groups", f"malformed measurement ({type(e).__name__}: {e})", where) from None
    return out


def _keys(cs, step, t_ref, t_orc) -> None:
    """Router logits of the exact reference and the oracle on the captured K2 inputs."""
    from .engine import chain_k2

    ranks = chain_k2(None, step.k2)
    for a, t in zip(ranks, t_ref):
        a["taps"] = t
    ref.k2_world(cs.k2_key, ranks)
    oranks = [ref.abi.oracle_args(a) for a in chain_k2(None, step.k2)]
    for a, t in zip(oranks, t_orc):
        a["taps"] = t
    ref.k2_world(cs.k2_key, oranks, mode="oracle")


def _worst(d: dict, k: str, v: float) -> None:
    v = float(v)
    d[k] = max(d.get(k, 0.0), v if math.isfinite(v) else math.inf)


def _round_up(x: float) -> float:
    """Two significant digits, upwards (a limit is never tighter than its measurement)."""
    if x <= 0 or not math.isfinite(x):
        return x
    e = math.floor(math.log10(x)) - 1
    return float(f"{math.ceil(x / 10 ** e - 1e-9)}e{e}")


def limits(meas: dict, seeds: int, source: str) -> dict:
    """{(config, fmt): {(stage, output, view): {criterion: limit, "why": text}}}; plus the tie
    windows as (stage k2, topk_ids, chained) entries."""
    out = {}
    for (cfg, fmt), g in meas.items():
        ent = {}
        for (stage, o, view), st in sorted(g["stats"].items()):
            e, notes = {}, []
            if view == "chained":
                for metric, crit in CHAINED_METRICS.items():
                    sp, orc = st.get(f"spread_{metric}", 0.0), st.get(f"oracle_{metric}", 0.0)
                    e[crit] = _round_up(max(NOISE_M * sp, FLOOR[metric]))
                    notes.append(f"{metric} perturb {sp:.2g} (ref-vs-oracle {orc:.2g})")
                    if metric == "mismatch_frac" and e[crit] > 1.0:
                        # a fraction: past 1 the chained criterion cannot fail; the isolated view judges
                        e[crit] = 1.0
                        notes.append("mismatch capped at 1: a correct kernel may differ anywhere here")
                rule = f"max({NOISE_M:g} x perturb, floor)"
            elif (stage, o) in ISO_FP32:
                sp = st.get("spread_rel_l2", 0.0)
                e["rel_l2_max"] = _round_up(max(NOISE_M * sp, FP32_FLOOR))
                notes.append(f"rel_l2 perturb {sp:.2g}")
                rule = f"max({NOISE_M:g} x perturb, 2^-18)"
            if e:
                e["why"] = (f"{g.get('source', source)}: {g['sets']} sets x {g.get('seeds', seeds)} seeds, worst " + "; ".join(notes)
                            + f"; limit = {rule}")
                ent[(stage, o, view)] = e
        if g["key_err"] > 0:
            ent[("k2", "topk_ids", "chained")] = {
                "tie_eps": _round_up(TIE_M * g["key_err"]),
                "why": f"derived from {g.get('source', source)}: worst |key_ref - key_oracle| {g['key_err']:.3g} over {g['sets']} "
                       f"sets; tie_eps = {TIE_M:g} x that"}
        out[(cfg, fmt)] = ent
    return out


def _general(lim: dict) -> dict:
    """Per format: the loosest limit over the derived configs (captures of any other preset)."""
    by_fmt: dict = defaultdict(dict)
    for (cfg, fmt), ent in lim.items():
        for k, e in ent.items():
            cur = by_fmt[fmt].setdefault(k, {})
            for c, v in e.items():
                if c != "why":
                    cur[c] = max(cur.get(c, 0.0), v)
            cur.setdefault("_cfgs", []).append(cfg)
    for fmt, ent in by_fmt.items():
        for k, e in ent.items():
            e["why"] = f"the loosest of the derived configs ({', '.join(sorted(set(e.pop('_cfgs'))))})"
    return by_fmt


def to_toml(lim: dict) -> str:
    """The derived block: [format.F.stage...] (any config) and [config.C.format.F.stage...]."""
    lines = [BLOCK_BEGIN]

    def emit(prefix, ent):
        for (stage, o, view), e in sorted(ent.items(), key=lambda kv: kv[0]):
            if view != "chained":
                head = f"[{prefix}view.isolated.stage.{stage}.{o}]"
            else:
                head = f"[{prefix}stage.{stage}.{o}]"
            lines.append(head)
            for c, v in e.items():
                if c != "why":
                    lines.append(f"{c} = {v:.2g}")
            lines.append(f'why = "{e["why"]}"')

    for fmt, ent in sorted(_general(lim).items()):
        emit(f"format.{fmt}.", ent)
    for (cfg, fmt), ent in sorted(lim.items()):
        if cfg != "?":
            emit(f"config.{cfg}.format.{fmt}.", ent)
    lines.append(BLOCK_END)
    return "\n".join(lines) + "\n"


def update_file(path: Path, block: str) -> None:
    text = path.read_text()
    if BLOCK_BEGIN in text and BLOCK_END in text:
        i, j = text.index(BLOCK_BEGIN), text.index(BLOCK_END) + len(BLOCK_END)
        text = text[:i] + block.rstrip("\n") + text[j:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    from .policy import load_policy

    load_policy(tmp)  # never install a policy that does not load
    tmp.replace(path)


def check(policy, lim: dict) -> list[str]:
    """Limits of `policy` looser than CHECK_SLACK x this derivation (per config and format)."""
    problems = []
    for (cfg, fmt), ent in lim.items():
        for (stage, o, view), e in ent.items():
            got = policy.criteria(stage, o, fmt, view, None if cfg == "?" else cfg)
            for c, v in e.items():
                if c == "why":
                    continue
                have = got.get(c)
                if have in (None, False):
                    problems.append(f"{cfg}/{fmt} {stage}/{o} ({view}): {c} not set (derived {v:.3g})")
                elif have > CHECK_SLACK * v:
                    problems.append(f"{cfg}/{fmt} {stage}/{o} ({view}): {c} = {have:.3g} is looser than "
                                    f"{CHECK_SLACK:g} x the derived {v:.3g}")
    return problems


def cli(argv) -> int:
    ap = ArgParser(prog="k3verify policy", description="tolerance policy tools")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=ArgParser)
    d = sub.add_parser("derive", help="measure the reference's spread and write the chained limits")
    d.add_argument("captures")
    d.add_argument("--seeds", type=int, default=4, help="perturb seeds per capture set (default 4)")
    d.add_argument("--device", default=None)
    d.add_argument("--out", help="write the derived block (a valid policy TOML) here")
    d.add_argument("--update", metavar="POLICY", help="rewrite the derived block inside this policy file")
    d.add_argument("--check", metavar="POLICY", nargs="?", const="", help="exit 1 if POLICY (default the "
                                                                           "shipped one) is looser than derived")
    d.add_argument("--save", metavar="JSON", help="also write this run's measurement here")
    d.add_argument("--include", metavar="JSON", action="append", default=[],
                   help="add a kept measurement (another machine's captures) to the block")
    d.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.seeds < 1:
        raise InputError("--seeds", f"{a.seeds} < 1")
    from .replay import check_outputs, resolve_device

    check_outputs(out=a.out, update=a.update, save=a.save)
    kept = {}
    for f in a.include:
        kept.update(load_measure(Path(f)))
    if a.update and not Path(a.update).is_file():
        raise InputError("--update", f"{a.update} is not a policy file")
    device = resolve_device(a.device)
    meas = measure(a.captures, a.seeds, device, progress=not a.quiet)
    source = f"`k3verify policy derive {a.captures} --seeds {a.seeds}`"
    if a.save:
        save_measure(meas, source, Path(a.save))
    lim = limits({**kept, **meas}, a.seeds, source)
    block = to_toml(lim)
    from .replay import _print

    if a.out:
        Path(a.out).write_text(block)
        _print(f"wrote {a.out}")
    if a.update:
        update_file(Path(a.update), block)
        _print(f"updated the derived block of {a.update}")
    if not (a.out or a.update or a.check is not None):
        _print(block)
    if a.check is not None:
        from .policy import load_policy

        problems = check(load_policy(a.check or None), lim)
        _print(*problems, f"policy check: {len(problems)} limit(s) looser than {CHECK_SLACK:g} x the derivation")
        return 1 if problems else 0
    return 0
