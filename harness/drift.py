"""`k3verify drift`: does a fused backend stay true over hundreds of decode steps? (issue K)

    k3verify drift --config tiny --layers 0-5 --steps 256 --num-spec 3 --backend triton \\
        [--experts F] [--accept random|all|none-then-all] [--padding P] [--lifetime T] [--seed N] \\
        [--chain] [--device D] [--report MD] [--json J] [--html H]

A per-step replay starts every step from captured state; drift runs three copies of the same
layer stack (`harness.layers.Stack`) closed-loop, each on its own conv and recurrent caches:
the backend, the exact reference and the oracle (float64, no bf16 rounding). Weights are held
once per (layer, rank) and shared read-only. Every step, fresh token rows enter the first layer
(the same carry for the three copies) and the request mix (`harness.synth.RequestMix`) decides
acceptance and which requests join (zeroed slots) or leave (their row becomes padding).

Coupled (the default): the three copies of a layer read the same input, the reference's carry
from the layer below, and every copy's MLP side (K2, the dense stand-in) reads the reference's
attention side (K1's core and carry): each kernel is judged on what it adds and accumulates in
its own state, not on upstream differences amplified through later layers. `--chain` runs each
copy on its own residual stream through the stack instead (measured and plotted, not judged by
the ratio: see harness.drift_policy.MEASURED).

Per step and layer it measures, between backend–reference, reference–oracle and backend–oracle:
rel L2 of the conv window and the recurrent state (the slots of live requests), of K1's
`core_out`, the prefix and `out` (live token rows); NaN/Inf counts; routing agreement (fraction of
live tokens with identical expert sets; the oracle's own picks from its keys). The oracle follows
the reference's routing, so its distances measure numerics; wherever the backend's picks differ
from the reference's (closed-loop their inputs differ by what accumulated upstream), the reference
and the oracle re-run K2 with the backend's picks, and the router itself is judged on its own keys
(picks = top-k of its logits but for near-ties, tie window of the replay policy). The drift policy
(`harness.drift_policy`) judges d(backend, oracle) ≤ k·d(ref, oracle) + floor; the run stops at
the first failing step and names step, layer, stage, tensor and coordinates.

Exit 0 when every step passes, 1 at a failure, 2 for bad input or usage.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import ref
from ref import synth as rsynth
from ref.config import EXPERT_FORMATS, PRESETS, Config, get_config
from ref.router import select

from . import drift_policy as dp
from .errors import InputError
from .layers import SpecStep, Stack, layer_caches, layer_weights
from .synth import ACCEPT_MODES, RequestMix, batch_shape, stack_layers
from .synth import check_args as synth_check_args

F64 = torch.float64
PAIRS = ("br", "ro", "bo")  # backend–reference, reference–oracle, backend–oracle
# stage of each tracked tensor, by layer kind (where a divergence seen first was born)
STAGES = {
    "k1_carry": {"*": "k1 · pending delta add + block write (prefix, bank)"},
    "conv": {"*": "k1 · short conv (conv window)"},
    "rstate": {"*": "k1 · KDA recurrence (recurrent state)"},
    "core": {"*": "k1 · gated norm (core_out)"},
    "prefix": {"dense": "dense MLP stand-in · prefix update (after K1)", "*": "k2 · o_proj + prefix update"},
    "out": {"dense": "dense MLP stand-in (after K1)", "*": "k2 · latent MoE + final reduce (out)"},
    "logits": {"*": "k2 · router logits"},
    "routing": {"*": "k2 · router (topk_ids against its own logits)"},
    "out_ranks": {"*": "k2 · final reduce (out identical on every rank)"},
    "core_padding": {"*": "k1 · padding rows of core_out (must be 0)"},
    "nonfinite": {"*": "NaN/Inf"},
}
# dataflow order within a layer: of several failures in one step, the first is where it was born
ORDER = ("k1_carry", "conv", "rstate", "core_padding", "core", "prefix", "logits", "routing", "out", "out_ranks")
DIMS = {"conv": ("rank", "slot", "channel", "pos"), "rstate": ("rank", "slot", "head", "v", "k"),
        "core": ("rank", "token", "channel"), "prefix": ("token", "channel"), "out": ("token", "channel"),
        "logits": ("rank", "token", "expert")}


def stage_of(tensor: str, kind: str) -> str:
    s = STAGES[tensor]
    return s.get(kind, s["*"])


@dataclass
class Failure:
    step: int
    layer: int
    kind: str
    tensor: str
    stage: str
    what: str  # one line: the criterion and the numbers
    where: dict = field(default_factory=dict)  # coordinates

    def line(self) -> str:
        loc = " ".join(f"{k}={v}" for k, v in self.where.items())
        return (f"step {self.step}, layer {self.layer} ({self.kind}), {self.stage}, tensor {self.tensor}"
                + (f" at {loc}" if loc else "") + f": {self.what}")


@dataclass
class DriftRun:
    """Everything a drift run measured (scalars only: O(steps) numbers, no tensors)."""

    config: str
    layers: list[int]
    kinds: dict
    steps: int
    num_spec: int
    experts: str
    accept: str
    lifetime: int
    chain: bool
    padding: int
    requests: int
    seed: int
    backend: str
    device: str
    k: float = dp.K
    floor: float = dp.FLOOR
    tie_eps: float = 0.0
    steps_run: int = 0
    seconds: float = 0.0
    setup_seconds: float = 0.0
    # (layer, tensor) -> {"br": [...], "ro": [...], "bo": [...], "nan": [[b, r, o] per step], ...}
    series: dict = field(default_factory=dict)
    routing: dict = field(default_factory=dict)  # layer -> {"br": [...], "ro": [...], "bo": [...], "forced": [...]}
    mix: list = field(default_factory=list)  # per step: live rows, num_acc, events
    failures: list[Failure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        return {
            "format": "k3verify-drift", "schema": 1, "passed": self.passed,
            "config": self.config, "layers": self.layers, "kinds": {str(k): v for k, v in self.kinds.items()},
            "steps": self.steps, "steps_run": self.steps_run, "num_spec": self.num_spec, "experts": self.experts,
            "accept": self.accept, "lifetime": self.lifetime, "chain": self.chain, "padding": self.padding, "requests": self.requests,
            "seed": self.seed, "backend": self.backend, "device": self.device,
            "policy": {"k": self.k, "floor": self.floor, "tie_eps": self.tie_eps, "metric": "rel_l2"},
            "seconds": self.seconds, "setup_seconds": self.setup_seconds,
            "seconds_per_step": self.seconds / self.steps_run if self.steps_run else None,
            "failures": [vars(f) for f in self.failures], "notes": self.notes,
            "series": [{"layer": layer, "tensor": t, **v} for (layer, t), v in sorted(self.series.items())],
            "routing": [{"layer": layer, **v} for layer, v in sorted(self.routing.items())],
            "mix": self.mix, "env": self.env,
        }


# ----------------------------------------------------------------------------- measuring

class _Rows:
    """Host-side index of one step's live rows and slots, moved to the device once."""

    def __init__(self, ms, L: int, device):
        live = ms.live_rows()
        st = ms.st_idx
        self.n_live = len(live)
        self.tokens = [r * L + j for r in live for j in range(L)]
        self.pad_tokens = [r * L + j for r in range(len(ms.live)) if not ms.live[r] for j in range(L)]
        self.slots = [int(st[r, j]) for r in live for j in range(L)]
        self.conv_slots = [int(st[r, 0]) for r in live]
        self.slot_row = {s: r for r in live for s in st[r].tolist()}
        ix = lambda v: torch.tensor(v, dtype=torch.long).to(device, non_blocking=True)  # noqa: E731
        self.t_tokens, self.t_pad = ix(self.tokens), ix(self.pad_tokens)
        self.t_slots, self.t_conv = ix(self.slots), ix(self.conv_slots)


def _sq(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ(a-b)², Σb²) in float64 (NaN propagates; counted apart)."""
    a, b = a.to(F64), b.to(F64)
    return ((a - b) ** 2).sum(), (b * b).sum()


def _nonfinite(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.isnan(t).sum(), torch.isinf(t).sum()


def _views(runner, tensor: str, rows: _Rows) -> list[torch.Tensor]:
    """The compared part of a tracked tensor, one piece per rank (or one for replicated ones)."""
    if tensor == "conv":
        return [c.index_select(0, rows.t_conv) for c, _ in runner.caches()]
    if tensor == "rstate":
        return [s.index_select(0, rows.t_slots) for _, s in runner.caches()]
    if tensor == "core":
        return [c.index_select(0, rows.t_tokens) for c in runner.cores]
    if tensor == "logits":  # replicated: rank 0's
        return [runner.last_taps["k2"][0]["logits"].index_select(0, rows.t_tokens)]
    raise KeyError(tensor)


def _tracked(kind: str, logits: bool = False) -> tuple[str, ...]:
    k1 = ("conv", "rstate", "core") if kind != "mla" else ()
    k2 = ("logits",) if logits and kind != "dense" else ()
    return k1 + ("prefix",) + k2 + ("out",)


def _measure(tensor, b, r, o, carries, rows: _Rows) -> list[torch.Tensor]:
    """Device scalars of one tensor: Σ(b-r)², Σr², Σ(r-o)², Σo², Σ(b-o)², then NaN/Inf of b, r, o
    (over everything the copy holds for it: padding rows included for row tensors)."""
    if tensor in ("prefix", "out"):
        i = 0 if tensor == "prefix" else 2
        full = [carries[c][i] for c in range(3)]
        pb, pr, po = ([t.index_select(0, rows.t_tokens)] for t in full)
        nf = [_nonfinite(t) for t in full]
    else:
        pb, pr, po = (_views(x, tensor, rows) for x in (b, r, o))
        if tensor == "core":
            nf = [_nonfinite(torch.stack(x.cores) if x.cores else torch.zeros(0)) for x in (b, r, o)]
        else:
            nf = [tuple(sum(v) for v in zip(*[_nonfinite(t) for t in parts])) for parts in (pb, pr, po)]
            if tensor == "logits":  # every row the backend wrote, padding included
                nf[0] = _nonfinite(b.last_taps["k2"][0]["logits"])
    acc = []
    for xs, ys in ((pb, pr), (pr, po), (pb, po)):
        sq = [_sq(x, y) for x, y in zip(xs, ys)]
        acc += [sum(s[0] for s in sq), sum(s[1] for s in sq)]
    del acc[4 + 1]  # Σo² twice (ro and bo): keep one
    out = acc + [v for pair in nf for v in pair]
    return [torch.as_tensor(v, dtype=F64).to(pb[0].device if pb else "cpu") for v in out]


def _dist(num: float, den: float) -> float:
    if math.isnan(num) or math.isnan(den):
        return math.nan
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def _worst(tensor, b, o, carries, rows: _Rows, L: int) -> dict:
    """Coordinates of the largest |backend - oracle| of a tracked tensor (a NaN wins; a non-finite
    value outside the live rows, e.g. in padding rows, is located first)."""
    if tensor in ("core", "prefix", "out"):
        full = b.cores if tensor == "core" else [carries[0][0 if tensor == "prefix" else 2]]
        bad = torch.stack([~torch.isfinite(x) for x in full])
        if bool(bad.any()):
            k = [int(v) for v in torch.nonzero(bad)[0].tolist()]
            loc = dict(zip(DIMS[tensor], k if tensor == "core" else k[1:]))
            loc.update(request_row=loc["token"] // L, value="non-finite")
            return loc
    if tensor in ("prefix", "out"):
        i = 0 if tensor == "prefix" else 2
        pb, po = [carries[0][i].index_select(0, rows.t_tokens)], [carries[2][i].index_select(0, rows.t_tokens)]
    else:
        pb, po = _views(b, tensor, rows), _views(o, tensor, rows)
    d = torch.stack([(x.to(F64) - y.to(F64)).abs() for x, y in zip(pb, po)])
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    flat = int(torch.argmax(d.reshape(-1)))
    idx = []
    for n in reversed(d.shape):
        flat, k = divmod(flat, n)
        idx.append(k)
    idx = idx[::-1]
    names = DIMS[tensor]
    if tensor in ("prefix", "out"):
        idx = idx[1:]
    loc = dict(zip(names, idx))
    if "token" in loc:
        tok = rows.tokens[loc["token"]]
        loc.update(token=tok, request_row=tok // L)
    if "slot" in loc:
        slot = (rows.slots if tensor == "rstate" else rows.conv_slots)[loc["slot"]]
        loc.update(slot=slot, request_row=rows.slot_row.get(slot))
    return loc


# ----------------------------------------------------------------------------- the run

def _load_backend(spec):
    from fast import backend_name

    from .replay import checked_backend

    if not isinstance(spec, str):
        return spec, backend_name(spec)
    b = checked_backend(spec, "backend")
    return b, backend_name(b, spec)


def check_args(cfg: Config, steps: int, num_spec: int, experts: str, accept: str, requests: int, padding: int,
               lifetime: int) -> None:
    synth_check_args(cfg, steps, num_spec, experts, requests, padding)
    if accept not in ACCEPT_MODES:
        raise InputError("accept", f"{accept!r} not in {', '.join(ACCEPT_MODES)}")
    if lifetime < 0:
        raise InputError("lifetime", f"{lifetime} < 0")


def drift(config, layers, steps: int = 256, num_spec: int = 3, backend="ref", *, experts: str = "mxfp4",
          accept: str = "random", padding: int | None = None, requests: int | None = None, lifetime: int = 64,
          seed: int = 0, device: str = "cpu", progress: bool = True, judge: bool = True, chain: bool = False,
          tie_eps: float | None = None) -> DriftRun:
    """Run the three copies closed-loop for `steps` steps (stops at the first failing step unless
    judge=False, which only measures). layers: 'a-b', a list, or None for every layer."""
    t_setup = time.perf_counter()
    cfg = config if isinstance(config, Config) else _config(config)
    layers = stack_layers(cfg, layers)
    L, R, pad = batch_shape(num_spec, requests, padding)
    check_args(cfg, steps, num_spec, experts, accept, R, pad, lifetime)
    bk, bname = _load_backend(backend)
    if tie_eps is None:
        from .policy import load_policy

        tie_eps = load_policy().tie_eps(experts)
    dev = torch.device(device)
    run = DriftRun(cfg.name, layers, {i: cfg.kind(i) for i in layers}, steps, num_spec, experts, accept, lifetime,
                   chain, pad, R, seed, bname, str(dev), tie_eps=tie_eps)
    from .results import collect_env

    run.env = collect_env(bk, str(dev))
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # fp32 GEMM bits depend on the BLAS thread count on some CPUs
    try:
        _run(run, cfg, layers, L, R, pad, bk, dev, progress, judge, t_setup)
    finally:
        torch.set_num_threads(threads)
    return run


def _config(name: str) -> Config:
    try:
        return get_config(name)
    except ValueError as e:
        raise InputError("config", str(e).split(": ", 1)[-1]) from None


def _run(run: DriftRun, cfg, layers, L, R, pad, bk, dev, progress, judge, t_setup) -> None:
    from fast.ref_backend import BACKEND as REF

    from .metrics import compare_routing

    S = R * L
    mix = RequestMix(R, L, pad, run.steps, run.seed, accept=run.accept, lifetime=run.lifetime, tag="drift")
    state_len = cfg.conv - 2 + L
    weights = [layer_weights(cfg, i, run.experts, run.seed, dev) for i in layers]
    b_taps = ("k2",) if "topk_ids" in getattr(bk, "TAPS_K2", ()) else ()
    logits = "logits" in getattr(bk, "TAPS_K2", ())
    if run.chain:
        run.notes.append("chain: every copy on its own residual stream through the stack; distances are measured "
                         "and plotted but not judged (a benign reordering reached a ratio of 15 on mxfp4, "
                         "harness.drift_policy.MEASURED): NaN/Inf and the exact rules are")
    if not b_taps:
        run.notes.append("the backend exposes no topk_ids tap: routing is not compared (a near-tie flip then "
                         "shows as divergence downstream)")
    common = dict(fmt=run.experts, num_spec=run.num_spec, conv_layout="SD")
    stacks = []
    for backend, kw in ((bk, dict(taps=b_taps)), (REF, dict(taps=("k2",), keep_k2_inputs=True)),
                        (REF, dict(taps=("k2",), keep_k2_inputs=True, mode="oracle"))):
        caches = [layer_caches(cfg, i, mix.total, state_len, run.seed, "drift-caches", dev) if cfg.has_k1(i)
                  else None for i in layers]
        stacks.append(Stack.build(cfg, layers, backend, weights, caches=caches, **common, **kw))
        del caches
    stacks[0].compile(S)
    B, Rf, O = (s.layers for s in stacks)
    for i in layers:
        run.series.update({(i, t): {p: [] for p in PAIRS} | {"nan": [], "inf": []} for t in _tracked(cfg.kind(i), logits)})
        if cfg.has_k2(i):
            run.routing[i] = {p: [] for p in PAIRS} | {"forced": []}
    run.setup_seconds = time.perf_counter() - t_setup

    from tqdm import tqdm

    bar = tqdm(total=run.steps, desc=f"drift {cfg.name} [{run.backend}]", unit="step", file=sys.stderr,
               disable=not progress, leave=False)
    t0 = time.perf_counter()
    for t in range(run.steps):
        ms = mix.step()
        rows = _Rows(ms, L, dev)
        run.mix.append({"live": ms.live_rows(), "num_acc": ms.num_acc.tolist(), "events": ms.events})
        g = rsynth.gen("cpu", run.seed, "drift-step", t)
        prefix, blocks, delta = rsynth.carry(cfg, S, layers[0], g, "cpu", with_delta=layers[0] > 0)
        if layers[0] == 0:
            prefix = blocks[:, 0].clone()  # layer 0: the prefix is the embedding itself
        carry0 = tuple(None if x is None else x.to(dev) for x in (prefix, blocks, delta))
        step = SpecStep(ms.st_idx.to(dev), ms.num_acc.to(dev), L, ms.fresh)
        carries = [carry0, carry0, carry0]  # each copy runs on its own from here
        vals, keys, forced, fails, after = [], [], {}, [], []
        for li, i in enumerate(layers):
            b, r, o = B[li], Rf[li], O[li]
            ab = b.attention(step, *carries[0])
            ar = r.attention(step, *carries[1])
            ao = o.attention(step, *carries[2])
            # coupled: every copy's MLP side reads the reference's attention side (each kernel judged
            # on its own); chain: each copy its own
            cb = b.mlp(*(ab if run.chain else ar))
            cr = r.mlp(*ar)
            rid = [tp["topk_ids"] for tp in r.last_taps["k2"]] if cfg.has_k2(i) else None
            co = o.mlp(*(ao if run.chain else ar), force_ids=rid)
            if cfg.has_k1(i) and not run.chain:  # K1's bookkeeping: the delta add and the block write
                keys.append((i, "k1_carry"))
                vals.append((ab[1].view(torch.int16) != ar[1].view(torch.int16)).sum()
                            + (ab[2].view(torch.int16) != ar[2].view(torch.int16)).sum())
            if cfg.has_k2(i) and rows.n_live:
                cr, co, nforced, fail = _routing(run, i, b, r, o, cr, co, rows, compare_routing)
                forced[i] = nforced
                if fail:
                    fails.append(Failure(t, i, cfg.kind(i), "routing", stage_of("routing", cfg.kind(i)), *fail))
            after.append([cb, cr, co])
            # the next layer's input: each copy's own (chain), or the reference's for all three
            carries = [cb, cr, co] if run.chain else [cr, cr, cr]
            if rows.n_live:
                for tensor in _tracked(cfg.kind(i), logits):
                    keys.append((i, tensor))
                    vals += _measure(tensor, b, r, o, after[-1], rows)
            # exact rules: out on every rank, padding rows of core_out
            if cfg.has_k2(i):
                keys.append((i, "out_ranks"))
                vals.append(sum(((b.outs[k].view(torch.int16) != b.outs[0].view(torch.int16)).sum()
                                 for k in range(1, len(b.outs))), torch.zeros((), dtype=torch.long, device=dev)))
            if cfg.has_k1(i) and rows.pad_tokens:
                keys.append((i, "core_padding"))
                vals.append(sum((c.index_select(0, rows.t_pad) != 0).sum() for c in b.cores))
            if cfg.has_k2(i):
                keys.append((i, "routing"))
                vals += _agreement(i, b, r, o, rows, dev)
        host = torch.stack([torch.as_tensor(v, dtype=F64).to(dev) for v in vals]).tolist() if vals else []
        fails += _record(run, t, keys, host, forced, cfg, judge)
        bar.update(1)
        run.steps_run = t + 1
        if judge and fails:
            fails.sort(key=lambda f: (f.layer, ORDER.index(f.tensor)))
            for f in fails:
                if f.tensor in DIMS:
                    li = layers.index(f.layer)
                    f.where = _worst(f.tensor, B[li], O[li], after[li], rows, L)
            run.failures = fails
            break
    bar.close()
    run.seconds = time.perf_counter() - t0


def _routing(run, i, b, r, o, cr, co, rows, compare_routing):
    """The router judged on its own keys, then the copies kept on one routing.

    Closed-loop, the three copies' inputs differ by what has accumulated upstream, so their picks
    may differ far from a near-tie; that divergence is judged by the distances. The router itself
    fails only where the backend's picks disagree with its own logits beyond a near-tie of its own
    keys. Wherever the backend's picks differ from the reference's, the reference and the oracle
    re-run K2 with the backend's picks, so the distances downstream compare like with like."""
    bt = b.last_taps.get("k2") or [None]
    if not bt[0] or "topk_ids" not in bt[0]:
        return cr, co, 0, None
    bid = [tp["topk_ids"] for tp in bt]
    rid = r.last_taps["k2"][0]["topk_ids"]
    tok = rows.t_tokens
    bias = b.w.k2[0]["bias"].to(F64)
    fail = None
    sb = bid[0].index_select(0, tok).sort(-1).values
    same = sb == rid.index_select(0, tok).sort(-1).values
    own_ok = torch.ones((), dtype=torch.bool, device=sb.device)
    if "logits" in bt[0]:
        blog = bt[0]["logits"].index_select(0, tok).to(F64)
        own, _ = select(blog, bias.to(blog.device), bid[0].shape[1])
        own_ok = (own.sort(-1).values == sb).all()
    # one host sync per MoE layer: the forcing decides what runs next
    ok_own, all_same = torch.stack([own_ok, same.all()]).tolist()
    if not ok_own:
        m = compare_routing(bid[0].index_select(0, tok).cpu(), own.cpu(),
                            (torch.sigmoid(blog) + bias.to(blog.device)).cpu(), run.tie_eps)
        if m["untied_tokens"]:
            toks = [rows.tokens[k] for k in m["untied_list"]]
            fail = (f"picks disagree with the backend's own router keys beyond a near-tie (boundary gap "
                    f"{m['boundary_gap']:.3g} > tie_eps {run.tie_eps:g}) on {len(toks)} token(s)",
                    {"token": toks[0], "request_row": toks[0] // (run.num_spec + 1), "tokens": toks})
    if all_same:
        return cr, co, 0, fail
    same = same.all(-1)
    force = [x.clone() for x in bid]
    cr = r.rerun_k2(force)
    co = o.rerun_k2(force)
    return cr, co, int((~same).sum()), fail


def _agreement(i, b, r, o, rows, dev) -> list[torch.Tensor]:
    """Fractions of live tokens with identical expert sets: br, ro, bo (the oracle's own picks)."""
    tok = rows.t_tokens
    rid = r.last_taps["k2"][0]["topk_ids"].index_select(0, tok)
    otap = o.last_taps["k2"][0]
    oid, _ = select(otap["logits"].index_select(0, tok), o.w.k2[0]["bias"].to(F64), rid.shape[1])
    bt = (b.last_taps.get("k2") or [None])[0]
    bid = bt["topk_ids"].index_select(0, tok) if bt and "topk_ids" in bt else None
    sets = lambda x: x.long().sort(-1).values  # noqa: E731
    agree = lambda x, y: (sets(x) == sets(y)).all(-1).double().mean()  # noqa: E731
    nan = torch.full((), math.nan, dtype=F64, device=dev)
    return [nan if bid is None else agree(bid, rid), agree(rid, oid.to(rid.device)),
            nan if bid is None else agree(bid, oid.to(bid.device))]


# exact rules: what a nonzero count of differing elements means
COUNTED = {"out_ranks": "of out differ between ranks (must be bit-identical)",
           "k1_carry": "of K1's prefix/bank differ from the reference's (bookkeeping: must be bit-identical)",
           "core_padding": "of padding rows are not 0"}


def _record(run: DriftRun, t: int, keys, host, forced, cfg, judge: bool) -> list[Failure]:
    """Append this step's numbers to the series; return what fails the policy (layer order)."""
    fails = []
    pos = 0
    for i, tensor in keys:
        kind = cfg.kind(i)
        if tensor in COUNTED:
            n = host[pos]
            pos += 1
            if n:
                fails.append(Failure(t, i, kind, tensor, stage_of(tensor, kind), f"{int(n)} element(s) {COUNTED[tensor]}"))
            continue
        if tensor == "routing":
            br, ro, bo = host[pos:pos + 3]
            pos += 3
            rt = run.routing[i]
            for p, v in zip(PAIRS, (br, ro, bo)):
                rt[p].append(None if math.isnan(v) else v)
            rt["forced"].append(forced.get(i, 0))
            continue
        v = host[pos:pos + 11]
        pos += 11
        nbr, dr, nro, do, nbo = v[:5]
        nan_b, inf_b, nan_r, inf_r, nan_o, inf_o = (int(x) for x in v[5:])
        d = {"br": _dist(nbr, dr), "ro": _dist(nro, do), "bo": _dist(nbo, do)}
        ser = run.series[(i, tensor)]
        for p in PAIRS:
            ser[p].append(d[p])
        ser["nan"].append([nan_b, nan_r, nan_o])
        ser["inf"].append([inf_b, inf_r, inf_o])
        if not judge:
            continue
        stage = stage_of(tensor, kind)
        if nan_b or inf_b:
            fails.append(Failure(t, i, kind, tensor, stage, f"backend holds {nan_b} NaN and {inf_b} Inf"))
        elif nan_r or inf_r or nan_o or inf_o:
            fails.append(Failure(t, i, kind, tensor, stage,
                                 f"the reference ({nan_r} NaN, {inf_r} Inf) or the oracle ({nan_o} NaN, {inf_o} "
                                 f"Inf) is not finite: the inputs or the harness are broken"))
        elif not run.chain and not dp.passes(tensor, d["bo"], d["ro"]):
            lim = dp.limit(tensor, d["ro"])
            fails.append(Failure(t, i, kind, tensor, stage,
                                 f"d(backend, oracle) {d['bo']:.3g} > k·d(ref, oracle) + floor = {run.k:g}·"
                                 f"{d['ro']:.3g} + {run.floor:g} = {lim:.3g} (d(backend, ref) {d['br']:.3g})"))
    for rt in run.routing.values():  # layers with no live tokens this step
        for p in PAIRS:
            if len(rt[p]) < t + 1:
                rt[p].append(None)
        if len(rt["forced"]) < t + 1:
            rt["forced"].append(0)
    for ser in run.series.values():
        for p in list(PAIRS) + ["nan", "inf"]:
            if len(ser[p]) < t + 1:
                ser[p].append(None)
    return fails


# ----------------------------------------------------------------------------- CLI

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise InputError("arguments", message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="k3verify drift", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--layers", default=None, help="consecutive layers 'a-b' or 'a' (default: every layer)")
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--num-spec", type=int, default=3, help="speculative tokens; L = num_spec + 1")
    p.add_argument("--backend", default="ref", help="ref | triton | flydsl | package.module:object")
    p.add_argument("--experts", default="mxfp4", help=f"expert format: {', '.join(EXPERT_FORMATS)}")
    p.add_argument("--accept", default="random", help=f"acceptance: {' | '.join(ACCEPT_MODES)}")
    p.add_argument("--requests", type=int, default=None, help="R rows (default: max(1, 8 // L), so S ≤ 8)")
    p.add_argument("--padding", type=int, default=None, help="rows that start as padding (default: 1 if R ≥ 2)")
    p.add_argument("--lifetime", type=int, default=64,
                   help="mean request lifetime in steps (requests join and leave); 0: they stay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chain", action="store_true",
                   help="each copy on its own residual stream through the stack (measured, not judged)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--report", help="write the Markdown report here")
    p.add_argument("--json", help="write the JSON report here")
    p.add_argument("--html", help="write the HTML report (drift plots) here")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def cli(argv) -> int:
    a = build_parser().parse_args(argv)
    for opt in ("report", "json", "html"):
        v = getattr(a, opt)
        if v and Path(v).is_dir():
            raise InputError(f"--{opt}", f"{v} is a folder")
    run = drift(a.config, a.layers, a.steps, a.num_spec, a.backend, experts=a.experts, accept=a.accept,
                padding=a.padding, requests=a.requests, lifetime=a.lifetime, seed=a.seed, device=a.device,
                progress=not a.quiet, chain=a.chain)
    from . import drift_report as rep

    print(rep.summary_line(run))
    print(rep.table(run))
    for line in rep.write_reports(run, md=a.report, json_path=a.json, html=a.html):
        print(line)
    return 0 if run.passed else 1
