"""Run one captured step through the oracle, the exact reference and a backend, and
collect every pair of tensors to judge (DESIGN §9).

A `Step` holds the launch inputs of one (step, layer) on every rank as the kernels
saw them. For a KDA layer the chain is K1 then K2 on each side (K2's core, prefix
and bank are that side's K1 outputs); an MLA layer has K2 alone, on the capture's
`core`. The engine:

1. poisons memory the step must not write (extra cache slots, the null slot, conv
   positions past the window, `core_out`/`out` filled with NaN) identically for all
   three sides, so an unwritten output or a stray write shows;
2. runs oracle (fp64), exact reference (with taps) and backend (with taps), chained;
3. applies the routing rule: top-k ids compared as sets; where they differ only at a
   near-tie of the oracle's keys, the reference's K2 is re-run with the backend's
   routing forced, and downstream stages are judged against that;
4. optionally (`noise` = N) re-runs the exact reference N times with `perturb` seeds;
5. optionally (`isolate`) feeds each reference stage the backend's previous tap.

It returns `Pair`s: candidate, reference, oracle, noise spread, with their stage,
output name, rank and view; `harness.replay` judges them against the policy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import ref
from ref.abi import K1_TAPS, K2_TAPS

from .isolate import clone_args, k1_isolated, k2_isolated

EXTRA_SLOTS = 2  # poisoned cache slots appended past the capture's own


@dataclass
class Step:
    id: str
    layer: int
    kind: str  # "kda" | "mla" | "dense"
    step: int
    world: int
    fmt: str
    k1_key: object | None
    k2_key: object
    k1: list[dict] | None  # per rank, K1 inputs (None for MLA layers)
    k2: list[dict] | None  # per rank, K2 inputs (None for a dense layer) (for KDA layers core/prefix/blocks are replaced by K1's outputs)
    meta: dict = field(default_factory=dict)


@dataclass
class Pair:
    stage: str  # "k1" | "k2" | "untouched"
    name: str  # output or tap name of harness.policy.STAGES[stage]
    rank: int
    view: str  # "chained" | "isolated"
    cand: torch.Tensor
    ref: torch.Tensor | None
    oracle: torch.Tensor | None = None
    noise: list[torch.Tensor] = field(default_factory=list)  # perturbed references
    dims: str | tuple | None = None
    exact: bool = False  # bookkeeping: must be bitwise equal
    note: str = ""


@dataclass
class StepRun:
    step: Step
    pairs: list[Pair]
    missing_taps: dict[str, list[str]]
    routing: dict  # per rank: compare_routing result or None
    forced_routing: bool
    errors: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- poisoning


def _poison_like(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Finite values far from real data, so stray copies are visible but validation passes."""
    v = torch.randn(t.shape, generator=g, dtype=torch.float32) * 100.0 + 4242.0
    return v.to(t.dtype).to(t.device)


def _grow(t: torch.Tensor, extra: int, g: torch.Generator) -> torch.Tensor:
    """Append `extra` poisoned slots on dim 0, keeping t's layout (a transposed view stays one)."""
    perm = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    shape = list(t.shape)
    shape[0] += extra
    big = torch.empty([shape[p] for p in perm], dtype=t.dtype, device=t.device)
    inv = [perm.index(d) for d in range(t.dim())]
    view = big.permute(*inv)
    view[: t.shape[0]] = t
    view[t.shape[0]:] = _poison_like(view[t.shape[0]:], g)
    return view


def prepare_k1(args: dict, key, seed: int) -> tuple[dict, dict]:
    """Poisoned copy of one rank's K1 inputs and the masks of memory it must not write."""
    g = torch.Generator()
    g.manual_seed(seed)
    a = clone_args(args)
    a["conv_state"] = _grow(args["conv_state"], EXTRA_SLOTS, g)
    a["rstate"] = _grow(args["rstate"], EXTRA_SLOTS, g)
    a["conv_state"][0] = _poison_like(a["conv_state"][0], g)
    a["rstate"][0] = _poison_like(a["rstate"][0], g)
    a["core_out"] = torch.full_like(args["core_out"], float("nan"))
    L = key.qlen
    st = a["st_idx"][:, :L].cpu().long()
    na = a["num_acc"].cpu().long()
    cs, rs = a["conv_state"].shape[0], a["rstate"].shape[0]
    W = a["conv_w"].shape[1]
    keep = W - 2 + L
    conv_written = torch.zeros(cs, dtype=torch.bool)
    rs_written = torch.zeros(rs, dtype=torch.bool)
    for r in range(st.shape[0]):
        if st[r, 0] > 0:
            conv_written[st[r, 0]] = True
        if st[r, na[r] - 1] > 0:
            for j in range(L):
                if st[r, j] > 0:
                    rs_written[st[r, j]] = True
    masks = dict(conv_written=conv_written, rs_written=rs_written, keep=keep, W=W,
                 write_idx=key.write_idx)
    return a, masks


# ---------------------------------------------------------------- running


def _k1_all(launch, key, args_list, taps_list, **kw):
    for a, t in zip(args_list, taps_list):
        launch(key, **a, **({"taps": t} if t is not None else {}), **kw)


def chain_k2(k1_after: list[dict] | None, k2_base: list[dict]) -> list[dict]:
    """K2 inputs of one side: fresh copies, `out` NaN-poisoned, and for a KDA layer the
    core/prefix/bank that side's K1 wrote."""
    out = []
    for r, a in enumerate(k2_base):
        b = clone_args(a)
        b["out"] = torch.full_like(b["out"], float("nan"))
        if k1_after is not None:  # copies: K2 updates prefix in place, K1's output must survive
            b.update(core=k1_after[r]["core_out"].clone(), prefix=k1_after[r]["prefix"].clone(),
                     blocks=k1_after[r]["blocks"].clone())
        out.append(b)
    return out


def _run_side(step: Step, k1_in, k2_in, kda_pre, k2_launch, with_taps=True, force=None, k1_only=False, **kw):
    """One side end to end. Returns (k1 args after, k2 args after, k1 taps, k2 taps).

    force: per-rank top-k ids the (reference) K2 must use instead of its own routing."""
    t1 = [{} if with_taps else None for _ in range(step.world)]
    t2 = [{} if with_taps else None for _ in range(step.world)]
    k1 = None
    if step.k1 is not None:
        k1 = [clone_args(a) for a in k1_in]
        _k1_all(kda_pre, step.k1_key, k1, t1, **kw)
    if k1_only or step.k2 is None:
        return k1, None, t1, t2
    k2 = chain_k2(k1, k2_in)
    for r, (a, t) in enumerate(zip(k2, t2)):
        if t is not None:
            a["taps"] = t
        if force is not None:
            a["force_ids"] = force[r].to(a["core"].device)
    ref.k2_world(step.k2_key, k2, launch=k2_launch, **kw)
    for a in k2:
        a.pop("taps", None)
        a.pop("force_ids", None)
    return k1, k2, t1, t2


def _slots_note(mask: torch.Tensor) -> str:
    """'slot' coordinates index the compared subset: name the cache slots it holds."""
    return "slots " + ",".join(str(i) for i in torch.nonzero(mask).flatten().tolist())


def _cpu(t):
    return None if t is None else t.detach().cpu()


def run_step(step: Step, backend, *, isolate: bool = False, noise: int = 0, seed: int = 0,
             tie_eps: float = 1e-6) -> StepRun:
    from .metrics import align_by_ids, compare_routing

    W = step.world
    k1_in, masks = None, None
    if step.k1 is not None:
        prep = [prepare_k1(a, step.k1_key, seed * 1000 + r) for r, a in enumerate(step.k1)]
        k1_in, masks = [p[0] for p in prep], [p[1] for p in prep]
    k2_in = None if step.k2 is None else [clone_args(a) for a in step.k2]

    # oracle (fp64), exact reference, backend — identical poisoned inputs
    o1_in = None if k1_in is None else [ref.upcast(a) for a in k1_in]
    o2_in = None if k2_in is None else [ref.upcast(a) for a in k2_in]
    rk1, rk2, rt1, rt2 = _run_side(step, k1_in, k2_in, ref.kda_pre, ref.k2_launch)
    # the oracle takes the exact reference's routing: its comparisons measure numerics, while
    # the routing itself is judged on the oracle's keys below
    ref_ids = None if rk2 is None else [t["topk_ids"] for t in rt2]
    ok1, ok2, ot1, ot2 = _run_side(step, o1_in, o2_in, ref.kda_pre, ref.k2_launch, force=ref_ids, mode="oracle")
    errors = []
    try:
        bk1, bk2, bt1, bt2 = _run_side(step, k1_in, k2_in, backend.kda_pre, backend.k2_launch)
    except Exception as e:  # K2 refused what K1 wrote (or K1 itself raised): judge what exists
        if step.k1 is None:
            raise
        errors.append(f"backend K2 failed after K1: {type(e).__name__}: {e}")
        bk1, bk2, bt1, bt2 = _run_side(step, k1_in, k2_in, backend.kda_pre, backend.k2_launch, k1_only=True)

    missing = {"k1": [t for t in K1_TAPS if step.k1 is not None and t not in bt1[0]],
               "k2": [t for t in K2_TAPS if step.k2 is not None and t not in bt2[0]]}

    # routing rule
    routing, forced = {}, False
    if bk2 is not None and "topk_ids" in bt2[0]:
        differs = False
        for r in range(W):
            keys = torch.sigmoid(ot2[r]["logits"]) + step.k2[r]["bias"].double().to(ot2[r]["logits"].device)
            routing[r] = compare_routing(_cpu(bt2[r]["topk_ids"]), _cpu(rt2[r]["topk_ids"]), _cpu(keys), tie_eps)
            differs |= not routing[r].get("sets_equal", True)
        if differs and all(routing[r].get("untied_tokens", 1) == 0 for r in range(W)):
            forced = True
            fid = [bt2[r]["topk_ids"] for r in range(W)]
            rk2, rt2 = _k2_only(step, rk1, k2_in, fid)
            ok2, ot2 = _k2_only(step, ok1, o2_in, fid, mode="oracle")

    # noise: perturbed exact references
    nz = []
    fid = None if rk2 is None else [t["topk_ids"] for t in (bt2 if forced else rt2)]
    for s in range(1, noise + 1):
        nz.append(_run_side(step, k1_in, k2_in, ref.kda_pre, ref.k2_launch, force=fid, perturb=s))

    pairs: list[Pair] = []

    def add(stage, name, r, cand, rf, orc=None, noise_list=(), dims=None, exact=False, view="chained", note=""):
        pairs.append(Pair(stage, name, r, view, _cpu(cand), _cpu(rf), _cpu(orc), [_cpu(n) for n in noise_list],
                          dims or name.split(".")[0], exact, note))

    for r in range(W):
        if step.k1 is not None:
            m = masks[r]
            nz1 = [n[0][r] for n in nz]
            nzt1 = [n[2][r] for n in nz]
            # bookkeeping outputs
            add("k1", "prefix", r, bk1[r]["prefix"], rk1[r]["prefix"], ok1[r]["prefix"], exact=True)
            wi = m["write_idx"]
            if wi >= 0:
                add("k1", "blocks", r, bk1[r]["blocks"][:, wi], rk1[r]["blocks"][:, wi],
                    ok1[r]["blocks"][:, wi], dims=("token", "channel"), exact=True)
            keep_rows = [i for i in range(k1_in[r]["blocks"].shape[1]) if i != wi]
            add("untouched", "blocks", r, bk1[r]["blocks"][:, keep_rows], k1_in[r]["blocks"][:, keep_rows],
                dims="blocks", exact=True)
            cw, keep, Wc = m["conv_written"], m["keep"], m["W"]
            bcs, rcs, ocs, ics = bk1[r]["conv_state"], rk1[r]["conv_state"], ok1[r]["conv_state"], k1_in[r]["conv_state"]
            ncar = Wc - 2  # carried window entries at [0, W-2), new in_proj values at [W-2, W-2+L)
            if bool(cw.any()):
                add("k1", "conv_carry", r, bcs[cw][..., :ncar], rcs[cw][..., :ncar], ocs[cw][..., :ncar],
                    dims="conv_state", exact=True, note=_slots_note(cw))
                add("k1", "conv_state", r, bcs[cw][..., ncar:keep], rcs[cw][..., ncar:keep],
                    ocs[cw][..., ncar:keep], [n["conv_state"][cw][..., ncar:keep] for n in nz1], dims="conv_state",
                    note=_slots_note(cw))
            # untouched: slots nobody writes, and positions past the window in written slots
            ut_b = [bcs[~cw].flatten()] + ([bcs[cw][..., keep:].flatten()] if bcs.shape[-1] > keep else [])
            ut_i = [ics[~cw].flatten()] + ([ics[cw][..., keep:].flatten()] if ics.shape[-1] > keep else [])
            add("untouched", "conv_state", r, torch.cat(ut_b), torch.cat(ut_i), dims=("element",), exact=True,
                note=f"slots {_slots_note(~cw)[6:]} whole; positions >= {keep} of slots "
                     f"{_slots_note(cw)[6:]}")
            rw = m["rs_written"]
            brs, rrs, ors, irs = bk1[r]["rstate"], rk1[r]["rstate"], ok1[r]["rstate"], k1_in[r]["rstate"]
            if bool(rw.any()):
                add("k1", "rstate", r, brs[rw], rrs[rw], ors[rw], [n["rstate"][rw] for n in nz1],
                    note=_slots_note(rw))
            add("untouched", "rstate", r, brs[~rw], irs[~rw], dims="rstate", exact=True, note=_slots_note(~rw))
            add("k1", "core_out", r, bk1[r]["core_out"], rk1[r]["core_out"], ok1[r]["core_out"],
                [n["core_out"] for n in nz1])
            for t in K1_TAPS:
                if t in bt1[r]:
                    add("k1", t, r, bt1[r][t], rt1[r][t], ot1[r][t], [n[t] for n in nzt1])
        if bk2 is None:
            continue
        nz2 = [n[1][r] for n in nz]
        nzt2 = [n[3][r] for n in nz]
        add("k2", "prefix", r, bk2[r]["prefix"], rk2[r]["prefix"], ok2[r]["prefix"], [n["prefix"] for n in nz2])
        blocks_in = bk1[r]["blocks"] if step.k1 is not None else k2_in[r]["blocks"]
        add("untouched", "k2_blocks", r, bk2[r]["blocks"], blocks_in, dims="blocks", exact=True)
        add("k2", "out", r, bk2[r]["out"], rk2[r]["out"], ok2[r]["out"], [n["out"] for n in nz2])
        if r > 0:
            add("k2", "out_ranks", r, bk2[r]["out"], bk2[0]["out"], dims="out", exact=True,
                note="out must be bit-identical on every rank")
        for t in K2_TAPS:
            if t in bt2[r]:
                cand = bt2[r][t]
                if t == "topk_w" and "topk_ids" in bt2[r]:  # same picks in another order at a near-tie
                    cand = align_by_ids(_cpu(bt2[r]["topk_ids"]), _cpu(cand), _cpu(rt2[r]["topk_ids"]))
                add("k2", t, r, cand, rt2[r][t], ot2[r][t] if t in ot2[r] else None,
                    [n[t] for n in nzt2 if t in n])

    if isolate:
        if step.k1 is not None:
            for r in range(W):
                iso = k1_isolated(step.k1_key, k1_in[r], bt1[r])
                for t, v in iso.items():
                    cand = bk1[r]["core_out"] if t == "core_out" else bt1[r][t]
                    add("k1", t, r, cand, v, view="isolated")
        k2_before = chain_k2(bk1, k2_in) if bk2 is not None else None
        iso2 = k2_isolated(step.k2_key, k2_before, bt2) if k2_before is not None else [{} for _ in range(W)]
        for r in range(W):
            for t, v in iso2[r].items():
                cand = bk2[r][t] if t in ("out", "prefix") else bt2[r].get(t)
                if cand is not None:
                    add("k2", t, r, cand, v, view="isolated")
    return StepRun(step, pairs, missing, routing, forced, errors)


def _k2_only(step, k1_after, k2_in, fid, **kw):
    """The reference's K2 alone on given K1 outputs, routing forced to `fid`."""
    t2 = [{} for _ in range(step.world)]
    k2 = chain_k2(k1_after, k2_in)
    for r, (a, t) in enumerate(zip(k2, t2)):
        a["taps"], a["force_ids"] = t, fid[r].to(a["core"].device)
    ref.k2_world(step.k2_key, k2, **kw)
    for a in k2:
        a.pop("taps")
        a.pop("force_ids")
    return k2, t2
