"""Tolerance policy (DESIGN §9): which criteria each stage output must meet, and the
judge that applies them to the metrics of `harness.metrics.compare`.

API (what the replay calls):

    pol = load_policy(path=None)                # None -> golden/tolerances.toml
    kw = pol.compare_kw(stage, output, fmt)     # {"atol", "rtol", "atol_rms"} for compare()
    m = compare(cand, ref, dims=output_name, **kw)
    res = judge(pol, stage, output, fmt, m, oracle=None, noise=None, view="chained")
    ok = passed(res)                            # every evaluated criterion passes
    pol.tie_eps(fmt)                            # routing near-tie epsilon (k2/topk_ids)

`oracle` = {"fast": compare(cand, oracle, detail=False), "ref": compare(ref, oracle, detail=False)}
enables `oracle_k`; without it that criterion is reported as skipped. `noise` = a list
of compare(ref_perturbed_seed_i, ref, detail=False) dicts, or a dict {metric: spread}, enables
`noise_m`; without it `noise_m` is not evaluated (noise runs are opt-in). For
k2/topk_ids pass the dict of `metrics.compare_routing`; `judge` reads its
`untied_tokens`.

Policy file (TOML; docs/tolerances.md explains every number):

    version = 1
    [defaults]                                  # every output starts from these
    [stage.<stage>.<output>]                    # criteria of one output (chained view)
    [format.<fmt>.stage.<stage>.<output>]       # override for one expert format
    [config.<preset>.stage.<stage>.<output>]    # chained limits derived for one config preset
    [config.<preset>.format.<fmt>.stage.<stage>.<output>]
    [view.isolated.stage.<stage>.<output>]      # override for the isolated view
    [format.<fmt>.view.isolated.stage.<stage>.<output>]

Merging, later wins: defaults, stage entry, format entry, config entry, config+format entry,
view entry, format+view entry; a key set to `false` in a later layer removes that criterion.
Any entry may carry `why = "..."`: where its numbers came from (`k3verify policy derive`
writes them); `Policy.why(...)` lists them. Stages and
outputs are listed in `STAGES`; an unknown stage, output, format, view or criterion,
or a value of the wrong type or range, raises `harness.errors.InputError` naming the
key path and the file.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ref.config import EXPERT_FORMATS

from .errors import InputError

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - 3.10
    import tomli as tomllib

DEFAULT_POLICY = Path(__file__).resolve().parent.parent / "golden" / "tolerances.toml"

K1_OUTPUTS = ("prefix", "blocks", "conv_carry", "conv_state", "rstate", "core_out", "core_pad")
K1_TAPS = ("x", "proj", "conv_out", "gate", "beta", "o")
K2_OUTPUTS = ("prefix", "out", "out_ranks")
K2_TAPS = ("delta", "x", "logits", "topk_ids", "topk_w", "lat", "sh", "y", "ln", "fin")
# Outputs and taps in dataflow order (reports list them so).
_K1_FLOW = ("prefix", "blocks", "x", "proj", "conv_out", "conv_carry", "conv_state", "gate", "beta", "o",
            "rstate", "core_out", "core_pad")
_K2_FLOW = ("delta", "prefix", "x", "logits", "topk_ids", "topk_w", "lat", "sh", "y", "ln", "fin", "out",
            "out_ranks")
assert set(_K1_FLOW) == set(K1_OUTPUTS + K1_TAPS) and set(_K2_FLOW) == set(K2_OUTPUTS + K2_TAPS)
# What each name compares (the replay chooses the regions):
#   k1/prefix      prefix after the pending-delta add (bit-exact bookkeeping)
#   k1/blocks      the written bank row blocks[:, write_idx] (bit-exact copy of the prefix)
#   k1/conv_carry  the W-2 window entries carried into the written conv slots (bit-exact)
#   k1/conv_state  the L new in_proj values written into the conv slots
#   k1/rstate      the recurrent states written (fp32)
#   k1/core_out    core_out of the real requests; K1 taps are judged on those rows too
#   k1/core_pad    core_out of the padding requests (start slot <= 0): the contract fixes it to 0
#   k2/out_ranks   rank r's `out` against rank 0's (must be bit-identical on every rank)
#   untouched/*    everything the step must not write, poisoned before the launch:
#                  conv_state / rstate slots and positions, bank rows K1 does not write
#                  (blocks), the whole bank under K2 (k2_blocks)
VIEWS = ("chained", "isolated")
STAGES: dict[str, tuple[str, ...]] = {
    "k1": _K1_FLOW,
    "k2": _K2_FLOW,
    "untouched": ("conv_state", "rstate", "blocks", "k2_blocks"),
}
_FLOW_INDEX = {(st, o): i for i, (st, o) in enumerate([("k1", o) for o in _K1_FLOW] + [("k2", o) for o in _K2_FLOW]
                                                      + [("untouched", o) for o in STAGES["untouched"]])}


def flow_index(stage: str, output: str) -> int:
    """Position of a stage output in the dataflow (K1 then K2; untouched memory last)."""
    return _FLOW_INDEX.get((stage, output), len(_FLOW_INDEX))


# Words for a report: what each stage output is (the tap name follows in parentheses).
STAGE_WORDS = {
    ("k1", "prefix"): "pending delta add", ("k1", "blocks"): "block write", ("k1", "x"): "AttnRes + input norm",
    ("k1", "proj"): "in_proj", ("k1", "conv_out"): "short conv", ("k1", "conv_carry"): "conv window carry",
    ("k1", "conv_state"): "conv state write", ("k1", "gate"): "decay gate", ("k1", "beta"): "beta gate",
    ("k1", "o"): "KDA recurrence", ("k1", "rstate"): "recurrent state write", ("k1", "core_out"): "gated norm",
    ("k1", "core_pad"): "padding rows (must be 0)",
    ("k2", "delta"): "o_proj + all-reduce", ("k2", "prefix"): "prefix update", ("k2", "x"): "MLP AttnRes + norm",
    ("k2", "logits"): "router logits", ("k2", "topk_ids"): "top-k selection", ("k2", "topk_w"): "routing weights",
    ("k2", "lat"): "latent down", ("k2", "sh"): "shared experts", ("k2", "y"): "routed experts",
    ("k2", "ln"): "latent all-reduce + norm", ("k2", "fin"): "up projection", ("k2", "out"): "final all-reduce",
    ("k2", "out_ranks"): "ranks agree",
    ("untouched", "conv_state"): "conv cache", ("untouched", "rstate"): "recurrent cache",
    ("untouched", "blocks"): "bank rows (K1)", ("untouched", "k2_blocks"): "bank (K2)",
}

# criterion -> (metric read, direction); "<=": value <= limit passes, ">=": value >= limit,
# "|<=|": |value| <= limit (the value is reported as |value|).
THRESHOLDS = {
    "cosine_min": ("cosine", ">="),
    "rel_l2_max": ("rel_l2", "<="),
    "max_abs_max": ("max_abs", "<="),
    "mean_abs_max": ("mean_abs", "<="),
    "max_ulp": ("max_ulp", "<="),
    "sqnr_min": ("sqnr_db", ">="),
    "calc_diff_max": ("calc_diff", "<="),
    "scale_err_max": ("scale_err", "|<=|"),
    "mismatch_max": ("mismatch_frac", "<="),
    "exact_frac_min": ("exact_frac", ">="),
}
# Metrics the oracle-ratio and noise criteria may name (lower is better).
ERROR_METRICS = ("rel_l2", "max_abs", "mean_abs", "max_ulp", "calc_diff", "mismatch_frac")

_NUM, _BOOL, _STR = "number", "boolean", "string"
# criterion -> (type, minimum, maximum)
CRITERIA: dict[str, tuple[str, float | None, float | None]] = {
    "exact": (_BOOL, None, None),
    "finite": (_BOOL, None, None),
    "cosine_min": (_NUM, -1.0, 1.0),
    "rel_l2_max": (_NUM, 0.0, None),
    "max_abs_max": (_NUM, 0.0, None),
    "mean_abs_max": (_NUM, 0.0, None),
    "max_ulp": (_NUM, 0.0, None),
    "sqnr_min": (_NUM, None, None),
    "calc_diff_max": (_NUM, 0.0, 2.0),
    "scale_err_max": (_NUM, 0.0, None),
    "mismatch_max": (_NUM, 0.0, 1.0),
    "exact_frac_min": (_NUM, 0.0, 1.0),
    "atol": (_NUM, 0.0, None),
    "rtol": (_NUM, 0.0, None),
    "atol_rms": (_NUM, 0.0, None),
    "oracle_k": (_NUM, 0.0, None),
    "oracle_floor": (_NUM, 0.0, None),
    "oracle_metric": (_STR, None, None),
    "noise_m": (_NUM, 0.0, None),
    "noise_floor": (_NUM, 0.0, None),
    "noise_metric": (_STR, None, None),
    "tie_eps": (_NUM, 0.0, None),
    "why": (_STR, None, None),  # where the entry's numbers came from (provenance; not judged)
}
# Parameters, not criteria: a `false` cannot remove them, they always have a value.
BUILTIN_DEFAULTS = {"finite": True, "atol": 0.0, "rtol": 1.6e-2, "atol_rms": 0.0, "oracle_metric": "rel_l2",
                    "oracle_floor": 0.0, "noise_metric": "rel_l2", "noise_floor": 0.0}


@dataclass
class CriterionResult:
    """One criterion applied to one comparison.

    `margin` is sign-consistent: >= 0 passes (limit - value for "<=" criteria, value -
    limit for ">=" ones; exact criteria pass at margin 0). `used` is the fraction of the
    error budget spent (value / limit; cosine, exact_frac: (1 - value) / (1 - limit); SQNR: the error
    power ratio 10^((limit - value) / 10)); > 1 fails. `skipped`: the data it needs was not
    supplied (value/limit/margin None, `passed` True, `note` says why).
    """

    name: str
    metric: str
    value: float | None
    limit: float | None
    margin: float | None
    passed: bool
    used: float | None = None
    skipped: bool = False
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "CriterionResult":
        return CriterionResult(**{k: d.get(k) for k in ("name", "metric", "value", "limit", "margin",
                                                        "passed", "used")},
                               skipped=bool(d.get("skipped", False)), note=d.get("note", ""))


def passed(results: list[CriterionResult]) -> bool:
    return all(r.passed or r.skipped for r in results)


class Policy:
    """A loaded, validated policy. `criteria(stage, output, fmt)` gives the merged entry."""

    def __init__(self, data: dict, path: str = "<memory>"):
        self.path = str(path)
        self._data = data
        self.version = _validate(data, self.path)
        self.defaults = {**BUILTIN_DEFAULTS, **data.get("defaults", {})}
        # (config or None, fmt or None, view or None, stage, output) -> entry
        self._entries: dict[tuple, dict] = {}
        tops = [(None, data)] + list(data.get("config", {}).items())
        for c, ctop in tops:
            for f, top in [(None, ctop)] + list(ctop.get("format", {}).items()):
                for v, tab in [(None, top)] + list(top.get("view", {}).items()):
                    for st, outs in tab.get("stage", {}).items():
                        for o, e in outs.items():
                            self._entries[(c, f, v, st, o)] = {k: x for k, x in e.items() if k != "why"}
        self._cache: dict = {}

    def criteria(self, stage: str, output: str, fmt: str | None = None, view: str = "chained",
                 config: str | None = None) -> dict:
        """Merged criteria of stage/output for expert format `fmt` (None: no format override) in
        `view` ("chained" | "isolated") for captures of preset `config` (None: no config override)."""
        key = (stage, output, fmt, view, config)
        if key not in self._cache:
            _check_name(stage, output, fmt, self.path)
            if view not in VIEWS:
                raise InputError("view", f"unknown view {view!r} (known: {', '.join(VIEWS)})", self.path)
            merged = dict(self.defaults)
            order = [(None, None, None), (None, fmt, None), (config, None, None), (config, fmt, None),
                     (None, None, view), (None, fmt, view),
                     (config, None, view), (config, fmt, view)]
            for layer in (self._entries.get((c, f, v, stage, output), {}) for c, f, v in order):
                for k, v in layer.items():
                    if v is False and k not in ("exact", "finite"):
                        merged.pop(k, None)
                        if k in BUILTIN_DEFAULTS:
                            merged[k] = BUILTIN_DEFAULTS[k]
                    else:
                        merged[k] = v
            self._cache[key] = merged
        return dict(self._cache[key])

    def why(self, stage: str, output: str, fmt: str | None = None, view: str = "chained",
            config: str | None = None) -> list[str]:
        """The provenance notes (`why`) of every layer that shaped this entry, general first."""
        out = []
        for c, f, v in [(None, None, None), (None, fmt, None), (config, None, None), (config, fmt, None),
                        (None, None, view), (None, fmt, view), (config, None, view), (config, fmt, view)]:
            tab = self._data
            for part in ([("config", c)] if c else []) + ([("format", f)] if f else []) + ([("view", v)] if v else []):
                tab = tab.get(part[0], {}).get(part[1], {})
            w = tab.get("stage", {}).get(stage, {}).get(output, {}).get("why")
            if w and w not in out:
                out.append(w)
        return out

    def compare_kw(self, stage: str, output: str, fmt: str | None = None, view: str = "chained",
                   config: str | None = None) -> dict:
        c = self.criteria(stage, output, fmt, view, config)
        return {"atol": float(c["atol"]), "rtol": float(c["rtol"]), "atol_rms": float(c["atol_rms"])}

    def tie_eps(self, fmt: str | None = None, config: str | None = None) -> float:
        return float(self.criteria("k2", "topk_ids", fmt, "chained", config).get("tie_eps", 0.0))

    def missing(self, fmt: str | None = None) -> list[tuple[str, str]]:
        """Stage outputs with no criterion beyond `finite` (they would pass on anything)."""
        judged = set(THRESHOLDS) | {"exact", "oracle_k", "noise_m", "tie_eps"}
        return [(s, o) for s, outs in STAGES.items() for o in outs
                if not judged & {k for k, v in self.criteria(s, o, fmt).items() if v is not False}]

    def to_dict(self) -> dict:
        return self._data


def load_policy(path=None) -> Policy:
    """Read and validate a TOML policy; None -> DEFAULT_POLICY."""
    p = Path(path) if path is not None else DEFAULT_POLICY
    if p.exists() and not p.is_file():
        raise InputError("policy", "not a regular file", where=str(p))
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise InputError("policy", f"cannot read: {e.strerror or e}", where=str(p)) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InputError("policy", f"not valid TOML: {str(e)[:200] or type(e).__name__}", where=str(p)) from None
    return Policy(data, str(p))


def _check_name(stage: str, output: str, fmt: str | None, where: str) -> None:
    if stage not in STAGES:
        raise InputError(f"stage.{stage}", f"unknown stage (known: {', '.join(STAGES)})", where)
    if output not in STAGES[stage]:
        raise InputError(f"stage.{stage}.{output}", f"unknown output (known: {', '.join(STAGES[stage])})",
                         where)
    if fmt is not None and fmt not in EXPERT_FORMATS:
        raise InputError(f"format.{fmt}", f"unknown expert format (known: {', '.join(EXPERT_FORMATS)})", where)


def _check_views(views, path: str, where: str) -> None:
    if not isinstance(views, dict):
        raise InputError(path, "must be a table", where)
    for v, tab in views.items():
        if v not in VIEWS:
            raise InputError(f"{path}.{v}", f"unknown view (known: {', '.join(VIEWS)})", where)
        if not isinstance(tab, dict):
            raise InputError(f"{path}.{v}", "must be a table", where)
        for k in tab:
            if k != "stage":
                raise InputError(f"{path}.{v}.{k}", "unknown key (known: stage)", where)
        _check_stages(tab.get("stage", {}), f"{path}.{v}.stage", where)


def _validate(data: dict, where: str) -> int:
    for k in data:
        if k not in ("version", "defaults", "stage", "format", "view", "config"):
            raise InputError(k, "unknown top-level key (known: version, defaults, stage, format, view, config)",
                             where)
    version = data.get("version", 1)
    if version != 1:
        raise InputError("version", f"unsupported policy version {version!r} (supported: 1)", where)
    _check_entry(data.get("defaults", {}), "defaults", where)
    _check_stages(data.get("stage", {}), "stage", where)
    _check_views(data.get("view", {}), "view", where)
    _check_formats(data.get("format", {}), "format", where, views=True)
    cfgs = data.get("config", {})
    if not isinstance(cfgs, dict):
        raise InputError("config", "must be a table", where)
    from ref.config import PRESETS

    for c, v in cfgs.items():
        if c not in PRESETS:
            raise InputError(f"config.{c}", f"unknown config preset (known: {', '.join(PRESETS)})", where)
        if not isinstance(v, dict):
            raise InputError(f"config.{c}", "must be a table", where)
        for k in v:
            if k not in ("stage", "format", "view"):
                raise InputError(f"config.{c}.{k}", "unknown key (known: stage, format, view)", where)
        _check_stages(v.get("stage", {}), f"config.{c}.stage", where)
        _check_views(v.get("view", {}), f"config.{c}.view", where)
        _check_formats(v.get("format", {}), f"config.{c}.format", where, views=True)
    return version


def _check_formats(fmts, path: str, where: str, views: bool) -> None:
    if not isinstance(fmts, dict):
        raise InputError(path, "must be a table", where)
    known = ("stage", "view") if views else ("stage",)
    for f, v in fmts.items():
        if f not in EXPERT_FORMATS:
            raise InputError(f"{path}.{f}", f"unknown expert format (known: {', '.join(EXPERT_FORMATS)})", where)
        if not isinstance(v, dict):
            raise InputError(f"{path}.{f}", "must be a table", where)
        for k in v:
            if k not in known:
                raise InputError(f"{path}.{f}.{k}", f"unknown key (known: {', '.join(known)})", where)
        _check_stages(v.get("stage", {}), f"{path}.{f}.stage", where)
        if views:
            _check_views(v.get("view", {}), f"{path}.{f}.view", where)


def _check_stages(stages, path: str, where: str) -> None:
    if not isinstance(stages, dict):
        raise InputError(path, "must be a table", where)
    for s, outs in stages.items():
        if s not in STAGES:
            raise InputError(f"{path}.{s}", f"unknown stage (known: {', '.join(STAGES)})", where)
        if not isinstance(outs, dict):
            raise InputError(f"{path}.{s}", "must be a table of outputs", where)
        for o, entry in outs.items():
            if o not in STAGES[s]:
                raise InputError(f"{path}.{s}.{o}", f"unknown output (known: {', '.join(STAGES[s])})", where)
            _check_entry(entry, f"{path}.{s}.{o}", where)


def _check_entry(entry, path: str, where: str) -> None:
    if not isinstance(entry, dict):
        raise InputError(path, "must be a table of criteria", where)
    for k, v in entry.items():
        if k not in CRITERIA:
            raise InputError(f"{path}.{k}", f"unknown criterion (known: {', '.join(CRITERIA)})", where)
        typ, lo, hi = CRITERIA[k]
        if v is False and typ != _BOOL:
            continue  # removes the criterion in this layer
        if typ == _BOOL:
            ok = isinstance(v, bool)
        elif typ == _STR:
            ok = isinstance(v, str)
        else:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
        if not ok:
            raise InputError(f"{path}.{k}", f"expected a {typ}, got {v!r}", where)
        if typ == _NUM and ((lo is not None and v < lo) or (hi is not None and v > hi)):
            rng = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
            raise InputError(f"{path}.{k}", f"{v!r} outside {rng}", where)
        if k in ("oracle_metric", "noise_metric") and v not in ERROR_METRICS:
            raise InputError(f"{path}.{k}", f"unknown metric {v!r} (known: {', '.join(ERROR_METRICS)})", where)


# ---------------------------------------------------------------- judging

def _result(name: str, metric: str, value, limit, direction: str, note: str = "") -> CriterionResult:
    value = float(value)
    limit = float(limit)
    if direction == "<=":
        margin = limit - value
        used = value / limit if limit > 0 else (0.0 if value <= 0 else math.inf)
    else:
        margin = value - limit
        if metric in ("cosine", "exact_frac"):  # budget = the complement 1 - limit
            used = (1.0 - value) / (1.0 - limit) if limit < 1 else (0.0 if value >= 1 else math.inf)
        elif metric == "sqnr_db":
            used = 10.0 ** min(300.0, (limit - value) / 10.0) if math.isfinite(value) or value < 0 else 0.0
        else:
            used = limit / value if value > 0 else math.inf
    ok = margin >= 0  # NaN fails
    if math.isnan(used):
        used = math.inf
    return CriterionResult(name, metric, value, limit, margin, bool(ok), used, False, note)


def _skipped(name: str, metric: str, note: str) -> CriterionResult:
    return CriterionResult(name, metric, None, None, None, True, None, True, note)


def noise_spread(noise) -> dict[str, float]:
    """Per metric, the largest error of the perturbed reference runs against the reference."""
    if isinstance(noise, dict):
        return {k: float(v) for k, v in noise.items()}
    out: dict[str, float] = {}
    for m in noise:
        for k in ERROR_METRICS:
            if k in m:
                out[k] = max(out.get(k, 0.0), float(m[k]))
    return out


def judge(policy: Policy, stage: str, output: str, fmt: str | None, metrics: dict,
          oracle: dict | None = None, noise=None, view: str = "chained", config: str | None = None
          ) -> list[CriterionResult]:
    """Apply the policy entry of stage/output (format `fmt`, `view`, preset `config`) to `metrics`
    (fast vs ref)."""
    crit = policy.criteria(stage, output, fmt, view, config)
    out: list[CriterionResult] = []
    if crit.get("finite", True):
        nonfinite = sum(int(metrics.get(k, 0)) for k in ("nan_a", "inf_a", "nan_b", "inf_b"))
        out.append(_result("finite", "nonfinite", nonfinite, 0, "<="))
    if crit.get("exact") is True:
        n_diff = metrics["n_differ"] if metrics.get("dtype_match", True) else metrics["n"]
        note = "" if metrics.get("dtype_match", True) else \
            f"dtype {metrics.get('dtype_a')} != {metrics.get('dtype_b')}"
        out.append(_result("exact", "n_differ", n_diff, 0, "<=", note))
    for name, (metric, direction) in THRESHOLDS.items():
        if crit.get(name) is not None and crit.get(name) is not False:
            value = metrics[metric]
            if direction == "|<=|":
                value, direction = abs(float(value)), "<="
            out.append(_result(name, metric, value, crit[name], direction))
    if crit.get("oracle_k") not in (None, False):
        metric = crit["oracle_metric"]
        if oracle is None:
            out.append(_skipped("oracle_k", metric, "no oracle comparison supplied"))
        else:
            lim = crit["oracle_k"] * float(oracle["ref"][metric]) + crit["oracle_floor"]
            out.append(_result("oracle_k", metric, oracle["fast"][metric], lim, "<=",
                               f"k={crit['oracle_k']:g} x ref {float(oracle['ref'][metric]):.3g}"
                               f" + {crit['oracle_floor']:g}"))
    if crit.get("noise_m") not in (None, False) and noise is not None:
        metric = crit["noise_metric"]
        spread = noise_spread(noise).get(metric)
        if spread is None:
            out.append(_skipped("noise_m", metric, f"noise runs lack metric {metric}"))
        else:
            lim = crit["noise_m"] * spread + crit["noise_floor"]
            out.append(_result("noise_m", metric, metrics[metric], lim, "<=",
                               f"m={crit['noise_m']:g} x spread {spread:.3g} + {crit['noise_floor']:g}"))
    if crit.get("tie_eps") not in (None, False):
        if "untied_tokens" in metrics:
            out.append(_result("routing", "untied_tokens", metrics["untied_tokens"], 0, "<=",
                               f"{metrics.get('set_diff_tokens', 0)} token(s) differ, "
                               f"tie_eps={crit['tie_eps']:g}"))
        else:
            out.append(_skipped("routing", "untied_tokens", "routing not evaluated (use compare_routing)"))
    return out


__all__ = ["Policy", "load_policy", "judge", "passed", "noise_spread", "CriterionResult", "STAGES", "STAGE_WORDS",
           "flow_index",
           "CRITERIA", "THRESHOLDS", "ERROR_METRICS", "DEFAULT_POLICY"]
