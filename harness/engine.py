"""Run one captured step through the oracle, the exact reference and a backend, and
collect every pair of tensors to judge (DESIGN §9).

A `Step` holds the launch inputs of one (step, layer) on every rank as the kernels saw
them. For a KDA or dense layer the chain starts with K1 (then K2 on K1's core, prefix and
bank, except on a dense layer); an MLA layer has K2 alone, on the capture's `core`.
`run_step` is these named steps:

1. `poison`: private copies of what the step writes (caches grown by poisoned slots, the
   null slot poisoned, `core_out`/`out` NaN-filled), identical for all three sides, so an
   unwritten output or a stray write shows; weights are shared read-only, never copied;
2. `run_side` for the exact reference (with taps) and the oracle (float64, the reference's
   routing), and `run_backend` under a time limit, with the backend's health and a check
   that it left its weights alone;
3. `routing_rule`: top-k ids compared as sets; where they differ only at a near-tie of the
   oracle's keys, the reference's and oracle's K2 are re-run with the backend's routing;
4. `noise_sides`: optional (`noise` = N) exact references under N `perturb` seeds;
5. `chained_pairs` and `isolated_pairs` (each reference stage fed the backend's previous
   taps, `harness.isolate`): the `Pair`s `harness.replay` judges.

Padding requests (start slot <= 0) are judged apart: their `core_out` rows must be exactly
zero (`k1/core_pad`), their K1 debug taps are not judged, and nothing of theirs may be
written (the untouched checks).
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

import ref
from ref.abi import K1_TAPS, K2_TAPS
from ref.comm import SimWorld

from .isolate import K1_WRITES, K2_WRITES, clone_state, delta_ulp_unit, k1_isolated, k2_isolated

EXTRA_SLOTS = 2  # poisoned cache slots appended past the capture's own
K1_STATE = K1_WRITES + ("delta", "st_idx", "num_acc")  # per-step inputs; everything else is a read-only weight
K2_STATE = K2_WRITES + ("core", "blocks")
DEFAULT_TIMEOUT = 600.0  # seconds a backend may take for one step (K1 and K2 of every rank)


class BackendTimeout(RuntimeError):
    """The backend did not finish one step within the time limit."""


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
    k2: list[dict] | None  # per rank, K2 inputs (None for a dense layer); a KDA layer's core/prefix/blocks
    meta: dict = field(default_factory=dict)  # are replaced by each side's K1 outputs


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
    rows: list[int] | None = None  # token rows of the full tensor that cand/ref hold (None: all)
    ulp_unit: torch.Tensor | None = None  # max_ulp's unit per element (metrics.compare_lazy)
    keys_from: tuple | None = None  # isolated top-k ids: (logits, bias) they were picked from


@dataclass
class Side:
    """One implementation's run of a step: launch args after it, and its taps, per rank."""

    k1: list[dict] | None
    k2: list[dict] | None
    t1: list[dict]
    t2: list[dict]

    def ids(self):
        return None if self.k2 is None else [t["topk_ids"] for t in self.t2]


@dataclass
class Poisoned:
    """What every side starts from: private K1 state per rank (weights shared), the masks of
    memory the step must not write, and the K2 inputs."""

    k1: list[dict] | None
    masks: list[dict] | None
    k2: list[dict] | None


@dataclass
class StepRun:
    step: Step
    pairs: list[Pair]
    missing_taps: dict[str, list[str]]
    routing: dict  # per rank: compare_routing result or None
    forced_routing: bool
    errors: list[str] = field(default_factory=list)  # the backend failed: the capture fails
    aborted: str | None = None  # the harness could not finish this step (a time limit)


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
    """Poisoned copy of one rank's K1 state (weights shared) and the masks of memory it must not write."""
    g = torch.Generator()
    g.manual_seed(seed)
    a = clone_state(args, K1_STATE)
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
    real = []
    for r in range(st.shape[0]):
        if st[r, 0] > 0:
            conv_written[st[r, 0]] = True
        if st[r, na[r] - 1] > 0:
            real += range(r * L, (r + 1) * L)
            for j in range(L):
                if st[r, j] > 0:
                    rs_written[st[r, j]] = True
    masks = dict(conv_written=conv_written, rs_written=rs_written, keep=keep, W=W, write_idx=key.write_idx,
                 real_rows=real, pad_rows=[t for t in range(st.shape[0] * L) if t not in set(real)])
    return a, masks


def poison(step: Step, seed: int) -> Poisoned:
    if step.k1 is None:
        return Poisoned(None, None, step.k2)
    prep = [prepare_k1(a, step.k1_key, seed * 1000 + r) for r, a in enumerate(step.k1)]
    return Poisoned([p[0] for p in prep], [p[1] for p in prep], step.k2)


def _oracle_in(args: dict) -> dict:
    """Oracle inputs: state and activations as float64 copies, the read-only weights shared in
    their stored dtype (the reference upcasts each exactly at use)."""
    return ref.abi.oracle_args(args)


# ---------------------------------------------------------------- running


def chain_k2(k1_after: list[dict] | None, k2_base: list[dict]) -> list[dict]:
    """K2 inputs of one side: private state (`out` NaN-poisoned, weights shared), and for a KDA
    layer the core/prefix/bank that side's K1 wrote."""
    out = []
    for r, a in enumerate(k2_base):
        b = clone_state(a, K2_STATE)
        b["out"] = torch.full_like(b["out"], float("nan"))
        if k1_after is not None:  # copies: K2 updates prefix in place, K1's output must survive
            b.update(core=k1_after[r]["core_out"].clone(), prefix=k1_after[r]["prefix"].clone(),
                     blocks=k1_after[r]["blocks"].clone())
        out.append(b)
    return out


def run_side(step: Step, k1_in, k2_in, kda_pre, k2_launch, with_taps=True, force=None, k1_only=False,
             comm=None, **kw) -> Side:
    """One side end to end from private copies of k1_in / k2_in.

    force: per-rank top-k ids the (reference) K2 must use instead of its own routing."""
    t1 = [{} if with_taps else None for _ in range(step.world)]
    t2 = [{} if with_taps else None for _ in range(step.world)]
    k1 = None
    if step.k1 is not None:
        k1 = [clone_state(a, K1_WRITES) for a in k1_in]
        for a, t in zip(k1, t1):
            kda_pre(step.k1_key, **a, **({"taps": t} if t is not None else {}), **kw)
    if k1_only or step.k2 is None:
        return Side(k1, None, t1, t2)
    k2 = chain_k2(k1, k2_in)
    for r, (a, t) in enumerate(zip(k2, t2)):
        if t is not None:
            a["taps"] = t
        if force is not None:
            a["force_ids"] = force[r].to(a["core"].device)
    ref.k2_world(step.k2_key, k2, launch=k2_launch, comm=comm, **kw)
    for a in k2:
        a.pop("taps", None)
        a.pop("force_ids", None)
    return Side(k1, k2, t1, t2)


def k2_rerun(step: Step, side: Side, k2_in, fid, **kw) -> Side:
    """The reference's K2 alone on `side`'s K1 outputs, routing forced to `fid`."""
    t2 = [{} for _ in range(step.world)]
    k2 = chain_k2(side.k1, k2_in)
    for r, (a, t) in enumerate(zip(k2, t2)):
        a["taps"], a["force_ids"] = t, fid[r].to(a["core"].device)
    ref.k2_world(step.k2_key, k2, **kw)
    for a in k2:
        a.pop("taps")
        a.pop("force_ids")
    return Side(side.k1, k2, side.t1, t2)


def _weights(step: Step) -> list[torch.Tensor]:
    """Every read-only tensor the backend is handed (shared with the reference sides)."""
    out, seen = [], set()
    for group, state in ((step.k1, K1_STATE), (step.k2, K2_STATE)):
        for a in group or ():
            for n, t in a.items():
                if n not in state and isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    out.append((n, t))
    return out


_BEFORE: dict[int, tuple] = {}  # id(weight) -> (weakref to it, its checksum before any backend ran)


_CHUNK_WORDS = 1 << 26  # int64 temporaries of at most 512 MiB, whatever the weight's size


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """[2] int64 on t's device: sums of t's 32-bit words at even and odd positions (a weight a
    backend wrote into changes them)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n4 = b.numel() // 4 * 4
    words = b[:n4].view(torch.int32)
    acc = torch.zeros(2, dtype=torch.int64, device=t.device)
    acc[0] += b[n4:].to(torch.int64).sum()
    for i in range(0, words.numel(), _CHUNK_WORDS):  # _CHUNK_WORDS is even: parity is kept
        w = words[i:i + _CHUNK_WORDS].to(torch.int64)
        acc[0] += w[0::2].sum()
        acc[1] += w[1::2].sum()
    return acc


def _checksums(weights, cached: bool) -> list[tuple]:
    """Checksums of every weight, one host transfer; `cached`: reuse a tensor's earlier sum."""
    if not weights:
        return []
    sums = []
    for _, t in weights:
        hit = _BEFORE.get(id(t)) if cached else None
        s = hit[1] if hit is not None and hit[0]() is t else None
        if s is None:
            s = _checksum(t)
            if cached:
                _BEFORE[id(t)] = (weakref.ref(t, lambda _, k=id(t): _BEFORE.pop(k, None)), s)
        sums.append(s.to("cpu", non_blocking=False) if s.device.type == "cpu" else s)
    by = torch.stack([s.to(sums[0].device) for s in sums]).cpu().tolist()
    return [tuple(x) for x in by]


def _deadline(fn, timeout: float | None, what: str, comm=None):
    """fn() in a daemon thread; BackendTimeout if it has not returned within `timeout` s (the
    thread is abandoned, `comm` aborted so the other ranks stop waiting)."""
    if timeout is None:
        return fn()
    box: dict = {}

    def body():
        try:
            box["r"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["e"] = e

    t = threading.Thread(target=body, daemon=True, name="k3backend")
    t.start()
    t.join(timeout)
    if t.is_alive():
        if comm is not None:
            comm.abort()
        raise BackendTimeout(f"{what} did not finish within {timeout:g} s (hung, or --timeout too short)")
    if "e" in box:
        raise box["e"]
    return box.get("r")


def run_backend(step: Step, p: Poisoned, backend, timeout: float | None = DEFAULT_TIMEOUT) -> tuple[Side, list]:
    """The backend's side under the time limit, its health, and its hands off the weights.
    Returns (side, errors); K2 refusing what K1 wrote still leaves K1 judged."""
    errors = []
    weights = _weights(step)
    before = _checksums(weights, cached=True)

    def go(k1_only=False):
        comm = SimWorld(step.world) if step.k2 is not None and not k1_only else None
        return _deadline(lambda: run_side(step, p.k1, p.k2, backend.kda_pre, backend.k2_launch, k1_only=k1_only,
                                          comm=comm),
                         timeout, f"backend on {step.id}", comm)

    try:
        side = go()
    except BackendTimeout:
        raise
    except Exception as e:  # noqa: BLE001 - K2 refused what K1 wrote (or K1 itself raised): judge what exists
        if step.k1 is None:
            raise
        errors.append(f"backend K2 failed after K1: {type(e).__name__}: {e}")
        side = go(k1_only=True)
    health = getattr(backend, "health", None)
    if callable(health):
        errors += [f"backend health: {h}" for h in _deadline(health, timeout, "backend health()")]
    after = _checksums(weights, cached=False)
    wrote = [(n, t) for (n, t), b0, b1 in zip(weights, before, after) if b0 != b1]
    for n, t in wrote:
        errors.append(f"backend wrote into its read-only input {n} (weights must not change)")
        _BEFORE.pop(id(t), None)
    if wrote:  # the weights are shared by every set of the layer: later sets load them afresh
        from .capture import CACHE

        CACHE.clear()
    return side, errors


def _drop_misshapen_taps(step: Step, bk: Side, rf: Side) -> list[str]:
    """A tap of another shape than the reference's is an error of the backend; it is dropped so
    everything else is still judged (and nothing is fed from it)."""
    errors = []
    for stage, bt, rt in (("k1", bk.t1, rf.t1), ("k2", bk.t2, rf.t2)):
        for r, (b, t) in enumerate(zip(bt, rt)):
            for name in [n for n in (b or {}) if n in (t or {})]:
                if tuple(b[name].shape) != tuple(t[name].shape):
                    errors.append(f"{stage}/{name} (tap) rank {r}: the backend's tensor has the wrong shape "
                                  f"{tuple(b[name].shape)}, expected {tuple(t[name].shape)}")
                    del b[name]
    return errors


def routing_rule(step: Step, bk: Side, rf: Side, orc: Side, p: Poisoned, o2_in, tie_eps: float):
    """Routing compared as sets on the oracle's keys; near-ties force the backend's picks on the
    reference and oracle K2. Returns (routing per rank, forced, rf, orc)."""
    from .metrics import compare_routing

    routing, forced = {}, False
    if bk.k2 is None or "topk_ids" not in bk.t2[0]:
        return routing, forced, rf, orc
    differs = False
    for r in range(step.world):
        sig_o = torch.sigmoid(orc.t2[r]["logits"])
        keys = sig_o + step.k2[r]["bias"].double().to(sig_o.device)
        key_err = (torch.sigmoid(rf.t2[r]["logits"].double()).to(sig_o.device) - sig_o).abs()
        routing[r] = compare_routing(_cpu(bk.t2[r]["topk_ids"]), _cpu(rf.t2[r]["topk_ids"]), _cpu(keys), tie_eps,
                                     key_err=_cpu(key_err))
        differs |= not routing[r].get("sets_equal", True)
    if differs and all(routing[r].get("untied_tokens", 1) == 0 for r in range(step.world)):
        forced = True
        fid = bk.ids()
        rf = k2_rerun(step, rf, p.k2, fid)
        orc = k2_rerun(step, orc, o2_in, fid, mode="oracle")
    return routing, forced, rf, orc


def noise_sides(step: Step, p: Poisoned, n: int, force) -> list[Side]:
    return [run_side(step, p.k1, p.k2, ref.kda_pre, ref.k2_launch, force=force, perturb=s) for s in range(1, n + 1)]


# ---------------------------------------------------------------- pairs


def _slots_note(mask: torch.Tensor) -> str:
    """'slot' coordinates index the compared subset: name the cache slots it holds."""
    return "slots " + ",".join(str(i) for i in torch.nonzero(mask).flatten().tolist())


def _take(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """t's slots where the (CPU, bool) mask is set, gathered on t's device without a host sync."""
    return t.index_select(0, torch.nonzero(mask).flatten().to(t.device))


def _cpu(t):
    return None if t is None else t.detach().cpu()


class _Pairs(list):
    def add(self, stage, name, r, cand, rf, orc=None, noise_list=(), dims=None, exact=False, view="chained",
            note="", rows=None, ulp_unit=None, keys_from=None):
        if rows is not None:
            idx = torch.tensor(rows, dtype=torch.long, device=cand.device)
            pick = lambda t: None if t is None else t.index_select(0, idx.to(t.device))  # noqa: E731
            cand, rf, orc, noise_list = pick(cand), pick(rf), pick(orc), [pick(t) for t in noise_list]
            ulp_unit = pick(ulp_unit)
        self.append(Pair(stage, name, r, view, cand, rf, orc, list(noise_list), dims or name.split(".")[0], exact,
                         note, rows, ulp_unit, keys_from))


def _k1_rows(m: dict, S: int):
    """Rows judged for K1's per-token outputs: the real requests' (None when there is no padding)."""
    return None if len(m["real_rows"]) == S else m["real_rows"]


def chained_pairs(step: Step, p: Poisoned, bk: Side, rf: Side, orc: Side, nz: list[Side]) -> _Pairs:
    pairs = _Pairs()
    add = pairs.add
    for r in range(step.world):
        if step.k1 is not None:
            m, k1_in = p.masks[r], p.k1[r]
            b1, r1, o1 = bk.k1[r], rf.k1[r], orc.k1[r]
            nz1, nzt1 = [n.k1[r] for n in nz], [n.t1[r] for n in nz]
            S = k1_in["prefix"].shape[0]
            rows = _k1_rows(m, S)
            # bookkeeping outputs
            add("k1", "prefix", r, b1["prefix"], r1["prefix"], o1["prefix"], exact=True)
            wi = m["write_idx"]
            if wi >= 0:
                add("k1", "blocks", r, b1["blocks"][:, wi], r1["blocks"][:, wi], o1["blocks"][:, wi],
                    dims=("token", "channel"), exact=True)
            keep_rows = [i for i in range(k1_in["blocks"].shape[1]) if i != wi]
            add("untouched", "blocks", r, b1["blocks"][:, keep_rows], k1_in["blocks"][:, keep_rows], dims="blocks",
                exact=True)
            cw, keep, Wc = m["conv_written"], m["keep"], m["W"]
            bcs, rcs, ocs, ics = b1["conv_state"], r1["conv_state"], o1["conv_state"], k1_in["conv_state"]
            ncar = Wc - 2  # carried window entries at [0, W-2), new in_proj values at [W-2, W-2+L)
            if bool(cw.any()):
                add("k1", "conv_carry", r, _take(bcs, cw)[..., :ncar], _take(rcs, cw)[..., :ncar],
                    _take(ocs, cw)[..., :ncar], dims="conv_state", exact=True, note=_slots_note(cw))
                add("k1", "conv_state", r, _take(bcs, cw)[..., ncar:keep], _take(rcs, cw)[..., ncar:keep],
                    _take(ocs, cw)[..., ncar:keep], [_take(n["conv_state"], cw)[..., ncar:keep] for n in nz1],
                    dims="conv_state", note=_slots_note(cw))
            # untouched: slots nobody writes, and positions past the window in written slots
            past = bcs.shape[-1] > keep
            ut_b = [_take(bcs, ~cw).flatten()] + ([_take(bcs, cw)[..., keep:].flatten()] if past else [])
            ut_i = [_take(ics, ~cw).flatten()] + ([_take(ics, cw)[..., keep:].flatten()] if past else [])
            add("untouched", "conv_state", r, torch.cat(ut_b), torch.cat(ut_i), dims=("element",), exact=True,
                note=f"slots {_slots_note(~cw)[6:]} whole; positions >= {keep} of slots {_slots_note(cw)[6:]}")
            rw = m["rs_written"]
            brs, rrs, ors, irs = b1["rstate"], r1["rstate"], o1["rstate"], k1_in["rstate"]
            if bool(rw.any()):
                add("k1", "rstate", r, _take(brs, rw), _take(rrs, rw), _take(ors, rw),
                    [_take(n["rstate"], rw) for n in nz1], note=_slots_note(rw))
            add("untouched", "rstate", r, _take(brs, ~rw), _take(irs, ~rw), dims="rstate", exact=True,
                note=_slots_note(~rw))
            if m["real_rows"]:
                add("k1", "core_out", r, b1["core_out"], r1["core_out"], o1["core_out"],
                    [n["core_out"] for n in nz1], rows=rows)
            if m["pad_rows"]:  # the contract fixes a padding request's core to 0
                add("k1", "core_pad", r, b1["core_out"], torch.zeros_like(b1["core_out"]), dims="core_out",
                    rows=m["pad_rows"], note="padding requests: core_out must be 0")
            for t in K1_TAPS:
                if t in bk.t1[r] and m["real_rows"]:
                    add("k1", t, r, bk.t1[r][t], rf.t1[r][t], orc.t1[r][t], [n[t] for n in nzt1], rows=rows)
        if bk.k2 is None:
            continue
        b2, r2, o2 = bk.k2[r], rf.k2[r], orc.k2[r]
        nz2, nzt2 = [n.k2[r] for n in nz], [n.t2[r] for n in nz]
        add("k2", "prefix", r, b2["prefix"], r2["prefix"], o2["prefix"], [n["prefix"] for n in nz2])
        blocks_in = bk.k1[r]["blocks"] if step.k1 is not None else p.k2[r]["blocks"]
        add("untouched", "k2_blocks", r, b2["blocks"], blocks_in, dims="blocks", exact=True)
        add("k2", "out", r, b2["out"], r2["out"], o2["out"], [n["out"] for n in nz2])
        if r > 0:
            add("k2", "out_ranks", r, b2["out"], bk.k2[0]["out"], dims="out", exact=True,
                note="out must be bit-identical on every rank")
        for t in K2_TAPS:
            if t in bk.t2[r]:
                cand = bk.t2[r][t]
                if t == "topk_w" and "topk_ids" in bk.t2[r]:  # same picks in another order at a near-tie
                    from .metrics import align_by_ids

                    cand = align_by_ids(bk.t2[r]["topk_ids"], cand, rf.t2[r]["topk_ids"])
                add("k2", t, r, cand, rf.t2[r][t], orc.t2[r].get(t), [n[t] for n in nzt2 if t in n])
    return pairs


def isolated_pairs(step: Step, p: Poisoned, bk: Side) -> _Pairs:
    """Each reference stage fed the backend's previous taps (harness.isolate); K1's per-token
    outputs on the real requests' rows, the written state slots of the recurrence and conv."""
    pairs = _Pairs()
    if step.k1 is not None:
        for r in range(step.world):
            m = p.masks[r]
            rows = _k1_rows(m, p.k1[r]["prefix"].shape[0])
            iso = k1_isolated(step.k1_key, p.k1[r], bk.t1[r])
            for t, v in iso.items():
                if t == "rstate":
                    rw = m["rs_written"]
                    if bool(rw.any()):
                        pairs.add("k1", "rstate", r, _take(bk.k1[r]["rstate"], rw), _take(v, rw), view="isolated",
                                  note=_slots_note(rw))
                elif t == "conv_state":
                    cw = m["conv_written"]
                    if bool(cw.any()):
                        lo, hi = m["W"] - 2, m["keep"]
                        pairs.add("k1", "conv_state", r, _take(bk.k1[r]["conv_state"], cw)[..., lo:hi],
                                  _take(v, cw)[..., lo:hi], dims="conv_state", view="isolated", note=_slots_note(cw))
                elif m["real_rows"]:
                    cand = bk.k1[r]["core_out"] if t == "core_out" else bk.t1[r].get(t)
                    if cand is not None:  # a tap the backend does not expose
                        pairs.add("k1", t, r, cand, v, view="isolated", rows=rows)
    if bk.k2 is not None:
        k2_before = chain_k2(bk.k1, p.k2)
        iso2 = k2_isolated(step.k2_key, k2_before, bk.t2)
        unit = delta_ulp_unit(k2_before, iso2[0]["delta"]) if "delta" in iso2[0] else None
        for r in range(step.world):
            for t, v in iso2[r].items():
                cand = bk.k2[r][t] if t in ("out", "prefix") else bk.t2[r].get(t)
                if cand is not None:
                    pairs.add("k2", t, r, cand, v, view="isolated", ulp_unit=unit if t == "delta" else None,
                              note="ulps of the rank partials summed" if t == "delta" else "",
                              keys_from=(bk.t2[r]["logits"], p.k2[r]["bias"]) if t == "topk_ids" else None)
    return pairs


def run_step(step: Step, backend, *, isolate: bool = True, noise: int = 0, seed: int = 0, tie_eps: float = 1e-6,
             timeout: float | None = DEFAULT_TIMEOUT) -> StepRun:
    p = poison(step, seed)
    o1_in = None if p.k1 is None else [_oracle_in(a) for a in p.k1]
    o2_in = None if p.k2 is None else [_oracle_in(a) for a in p.k2]
    rf = run_side(step, p.k1, p.k2, ref.kda_pre, ref.k2_launch)
    # the oracle takes the exact reference's routing: its comparisons measure numerics, while
    # the routing itself is judged on the oracle's keys (routing_rule)
    orc = run_side(step, o1_in, o2_in, ref.kda_pre, ref.k2_launch, force=rf.ids(), mode="oracle")
    try:
        bk, errors = run_backend(step, p, backend, timeout)
    except BackendTimeout as e:
        return StepRun(step, [], {}, {}, False, [], aborted=str(e))
    errors += _drop_misshapen_taps(step, bk, rf)
    missing = {"k1": [t for t in K1_TAPS if step.k1 is not None and t not in bk.t1[0]],
               "k2": [t for t in K2_TAPS if step.k2 is not None and bk.k2 is not None and t not in bk.t2[0]]}
    routing, forced, rf, orc = routing_rule(step, bk, rf, orc, p, o2_in, tie_eps)
    fid = None if rf.k2 is None else (bk.ids() if forced else rf.ids())
    nz = noise_sides(step, p, noise, fid)
    pairs = chained_pairs(step, p, bk, rf, orc, nz)
    if isolate:
        pairs += isolated_pairs(step, p, bk)
    return StepRun(step, pairs, missing, routing, forced, errors)
