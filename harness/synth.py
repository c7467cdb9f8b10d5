"""`k3verify synth`: synthetic captures from a reference run over a stack of layers (DESIGN §8).

    k3verify synth --config tiny --layers 0-5 --steps 8 --num-spec 3 --experts mxfp4 --seed 0 --out DIR

Per decode step, fresh token rows enter the first layer (AttnRes carry from
`ref.synth.carry`; at layer 0 the prefix is the embedding and there is no pending
delta) and flow through the stack of layer runners (`harness.layers`, the one
composition of the layer flow: KDA layer = K1 then K2, dense layer 0 = K1 then the dense
MLP stand-in, MLA layer = the AttnRes op and the MLA stand-in then K2), driven through
the reference; an observer turns every launch into captures. K2's `out` is the next
layer's pending delta; K1's block write and K2's reset follow the config's block schedule.

Speculative decoding: R rows of L = num_spec + 1 tokens (`RequestMix`). Each live request
owns L slots of a cache with twice as many slots as referenced (random ids, slot 0 the null
slot), so step t+1 with acceptance a starts from slot st_idx[r, a-1], exactly where step t
wrote the state after its a-th token. The last `padding` rows are padding (null slots 0 and
-1). Acceptance is random in 1..L (with R ≥ 2 the run shows a = L and a = 1 on purpose), all,
or none-then-all, unless given; with `lifetime` requests join (fresh zeroed slots) and leave
(their row turns into padding). Every random draw comes from a generator seeded by (seed,
what it is for): the same command writes the same bytes.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

import ref
from ref import synth as rsynth
from ref.config import EXPERT_FORMATS, PRESETS, Config, get_config, k2_build

from . import capture as cap
from .errors import InputError
from .layers import Observer, SpecStep, Stack, dense_mlp, layer_caches, layer_weights  # noqa: F401 - dense_mlp: public here too

BF16 = torch.bfloat16
TOOL = "k3verify synth"


def parse_layers(spec: str, cfg: Config) -> list[int]:
    """'a-b' or 'a' -> [a..b]; the stack must be consecutive layers of the config."""
    try:
        if "-" in spec:
            a, b = (int(x) for x in spec.split("-", 1))
        else:
            a = b = int(spec)
    except ValueError:
        raise InputError("layers", f"{spec!r} is not 'a-b' or 'a'") from None
    if not 0 <= a <= b < cfg.layers:
        raise InputError("layers", f"{spec!r} outside 0..{cfg.layers - 1} of config {cfg.name}")
    return list(range(a, b + 1))


def slot_plan(R: int, L: int, padding: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """st_idx [R, L] int32 over a cache of 1 + 2·R·L slots: real requests get random distinct
    slot ids, the last `padding` requests null slots (0, then -1, alternating)."""
    total = 1 + 2 * R * L
    perm = (torch.randperm(total - 1, generator=g) + 1).to(torch.int32)
    st = torch.empty(R, L, dtype=torch.int32)
    for r in range(R):
        p = r - (R - padding)
        st[r] = perm[r * L:(r + 1) * L] if p < 0 else (0 if p % 2 == 0 else -1)
    return st, total


ACCEPT_MODES = ("random", "all", "none-then-all")


@dataclass
class MixStep:
    """One step of a request mix: st_idx [R, L] int32 and num_acc [R] int32 (CPU), which rows hold a
    live request, the slots of requests joining this step (zeroed before it runs), and what changed."""

    st_idx: torch.Tensor
    num_acc: torch.Tensor
    live: list[bool]
    fresh: tuple[int, ...] = ()
    events: list[str] = field(default_factory=list)

    def live_rows(self) -> list[int]:
        return [r for r, v in enumerate(self.live) if v]


class RequestMix:
    """The rows of a spec-verify batch over the steps of a run (R rows of L tokens).

    A live row owns L slots of a cache of 1 + 2·R·L (slot 0 the null slot); the last `padding`
    rows start as padding. Padding rows carry null slots, 0 or -1 alternating by row and step, so
    two steps show both. Acceptance per live row (`accept`): random in 1..L; all (L); none-then-all
    (1 for the first half of the steps, then L). With R ≥ 2 a random run covers full acceptance
    (a = L) and zero-extra acceptance (a = 1) on purpose: the first two live (step, row) pairs get
    L and 1 (in one step when it has two live rows). `num_acc` [steps][R] overrides every draw.

    lifetime > 0: requests join and leave. After each step a live request finishes with
    probability 1/lifetime and its row turns into padding; a padding row takes a new request with
    the probability that keeps `padding` rows idle on average (at least one step idle). A new
    request gets L free slots, zeroed before its first step (it has no prefill state). Draws come
    from generators seeded by (seed, tag, what, step): the same arguments give the same mix.
    """

    def __init__(self, R: int, L: int, padding: int, steps: int, seed: int, *, accept: str = "random",
                 lifetime: int = 0, num_acc=None, tag: str = "synth"):
        if accept not in ACCEPT_MODES:
            raise InputError("accept", f"{accept!r} not in {', '.join(ACCEPT_MODES)}")
        if lifetime < 0:
            raise InputError("lifetime", f"{lifetime} < 0")
        self.R, self.L, self.steps, self.seed, self.tag = R, L, steps, seed, tag
        self.accept, self.lifetime, self.num_acc, self.padding = accept, lifetime, num_acc, padding
        self.st, self.total = slot_plan(R, L, padding, rsynth.gen("cpu", seed, f"{tag}-slots"))
        self.live = [r < R - padding for r in range(R)]
        used = {int(v) for r in range(R) if self.live[r] for v in self.st[r].tolist()}
        self.free = [s for s in range(1, self.total) if s not in used]
        self.p_leave = 1.0 / lifetime if lifetime else 0.0
        self.p_join = min(1.0, self.p_leave * (R - padding) / padding) if padding else 1.0
        self.t = 0
        self._covered: list[int] = []  # accept values still to place (a = L, then a = 1)
        if accept == "random" and num_acc is None and R >= 2:
            self._covered = [L, 1] if L > 1 else [L]

    def _null(self, r: int) -> int:
        # the first padding row starts at 0, as slot_plan lays them out
        return 0 if (r - self.R + self.padding + self.t) % 2 == 0 else -1

    def step(self) -> MixStep:
        """The next step's rows. Leaves and joins decided at the end of step t show in step t+1."""
        t, R, L = self.t, self.R, self.L
        fresh, events = [], []
        if t > 0 and self.lifetime:
            g = rsynth.gen("cpu", self.seed, f"{self.tag}-churn", t)
            u = torch.rand(R, generator=g).tolist()
            for r in range(R):
                if self.live[r] and u[r] < self.p_leave:
                    self.free.extend(int(v) for v in self.st[r].tolist())
                    self.live[r] = False
                    events.append(f"leave row {r}")
                elif not self.live[r] and u[r] < self.p_join and len(self.free) >= L:
                    pick = torch.randperm(len(self.free), generator=g)[:L].tolist()
                    slots = [self.free[i] for i in pick]
                    self.free = [s for i, s in enumerate(self.free) if i not in set(pick)]
                    self.st[r] = torch.tensor(slots, dtype=torch.int32)
                    self.live[r] = True
                    fresh += slots
                    events.append(f"join row {r}")
        st = self.st.clone()
        for r in range(R):
            if not self.live[r]:
                st[r] = self._null(r)
        if self.num_acc is not None:
            na = torch.tensor(self.num_acc[t], dtype=torch.int32)
        elif self.accept == "all":
            na = torch.full((R,), L, dtype=torch.int32)
        elif self.accept == "none-then-all":
            na = torch.full((R,), 1 if t < self.steps // 2 else L, dtype=torch.int32)
        else:
            na = torch.randint(1, L + 1, (R,), generator=rsynth.gen("cpu", self.seed, f"{self.tag}-accept", t),
                               dtype=torch.int32)
            for r in range(R):
                if self._covered and self.live[r]:
                    na[r] = self._covered.pop(0)
        self.t += 1
        return MixStep(st, na, list(self.live), tuple(fresh), events)


def check_args(cfg: Config, steps: int, num_spec: int, experts: str, requests: int, padding: int,
                num_acc=None) -> None:
    """The run's shape against the config (InputError naming the field)."""
    if experts not in EXPERT_FORMATS:
        raise InputError("experts", f"{experts!r} not in {', '.join(EXPERT_FORMATS)}")
    if steps < 1:
        raise InputError("steps", f"{steps} < 1")
    if num_spec < 0:
        raise InputError("num-spec", f"{num_spec} < 0")
    if requests < 1:
        raise InputError("requests", f"{requests} < 1")
    if not 0 <= padding < requests:
        raise InputError("padding", f"{padding} outside 0..{requests - 1} (at least one real request)")
    if num_acc is not None:
        L = num_spec + 1
        if len(num_acc) != steps or any(len(a) != requests for a in num_acc):
            raise InputError("num_acc", f"needs {steps} steps × {requests} requests")
        if any(not 1 <= x <= L for a in num_acc for x in a):
            raise InputError("num_acc", f"values outside 1..{L}")


WEIGHT_SOURCES = ("recipe", "stored")


class _Weights:
    """One layer's per-rank weights and how the captures name them: by recipe (default: the
    generator's name, seed and coordinates plus a digest per tensor, regenerated at replay), or
    stored once under ROOT/weights (content-addressed) and then used memory-mapped from there."""

    def __init__(self, root: Path, cfg: Config, layer: int, fmt: str, seed: int, device, source: str = "recipe"):
        self.kind = cfg.kind(layer)
        self.addr1: list = []
        self.addr2: list = []
        w = layer_weights(cfg, layer, fmt, seed, device)
        if source == "recipe":
            if w.k1 is not None:
                self.addr1 = [cap.recipe_entry(cfg, layer, r, None, seed, "k1", t) for r, t in enumerate(w.k1)]
            if w.k2 is not None:
                self.addr2 = [cap.recipe_entry(cfg, layer, r, fmt, seed, "k2", t) for r, t in enumerate(w.k2)]
        else:
            if w.k1 is not None:
                self.addr1 = [cap.store_weights(root, t) for t in w.k1]
                w.k1 = [self._mapped(root, a, device) for a in self.addr1]
            if w.k2 is not None:
                self.addr2 = [cap.store_weights(root, t) for t in w.k2]
                w.k2 = [{"w13s": None, "w2s": None, **self._mapped(root, a, device)} for a in self.addr2]
        self.weights = w

    @staticmethod
    def _mapped(root: Path, addr: str, device) -> dict:
        w = cap.load_weights(Path(root) / "weights" / f"{addr}.safetensors", verify=False)
        return w if torch.device(device).type == "cpu" else {n: t.to(device) for n, t in w.items()}


class _Recorder(Observer):
    """Turns the runners' launches into one StepRecord per (layer, rank) and writes the captures."""

    def __init__(self, out: Path, cfg: Config, fmt: str, meta: dict, prod: dict, weights: dict, total: int,
                 after: bool = True):
        self.out, self.cfg, self.fmt, self.meta, self.prod, self.weights, self.total = (
            out, cfg, fmt, meta, prod, weights, total)
        self.after = after
        self.written: list[Path] = []
        self.recs: dict[int, list[cap.StepRecord]] = {}
        self.step = 0
        self.st_idx = self.num_acc = self.smap = None

    def begin(self, t: int, st_idx: torch.Tensor, num_acc: torch.Tensor, L: int) -> None:
        self.step, self.st_idx, self.num_acc = t, st_idx, num_acc
        self.smap = cap.slot_map_for(st_idx, L)

    def _recs(self, layer: int, k2key) -> list[cap.StepRecord]:
        if layer not in self.recs:
            w = self.weights[layer]
            self.recs[layer] = [cap.StepRecord(step=self.step, layer=layer, rank=r, world=self.cfg.world, kind=w.kind,
                                               fmt=self.fmt, k2_key=k2key, k2_in=None,
                                               k2_weights=w.addr2[r] if w.addr2 else None, cfg=self.cfg,
                                               meta=self.meta, after=self.after)
                                for r in range(self.cfg.world)]
        return self.recs[layer]

    def _k2key(self, layer: int, S: int):
        return None if self.cfg.kind(layer) == "dense" else k2_build(self.cfg, layer, S, self.fmt)

    def before_k1(self, layer, rank, key, a):
        rec = self._recs(layer, self._k2key(layer, key.tokens))[rank]
        rec.k1_in = dict(prefix=a["prefix"].clone(), delta=a["delta"], blocks=a["blocks"].clone(),
                         conv_state=cap.compact_cache(a["conv_state"], self.smap),
                         rstate=cap.compact_cache(a["rstate"], self.smap), st_idx=self.st_idx, num_acc=self.num_acc)

    def after_k1(self, layer, rank, key, a):
        rec = self.recs[layer][rank]
        rec.k1_after = dict(prefix=a["prefix"], blocks=a["blocks"],
                            conv_state=cap.compact_cache(a["conv_state"], self.smap),
                            rstate=cap.compact_cache(a["rstate"], self.smap), core_out=a["core_out"])
        rec.k1_key, rec.k1_weights = key, self.weights[layer].addr1[rank]
        rec.slot_map, rec.conv_slots, rec.rec_slots = self.smap, self.total, self.total
        rec.conv_layout = cap.conv_layout_of(a["conv_state"])

    def before_k2(self, layer, key, ranks):
        for r, rec in enumerate(self._recs(layer, key)):
            rec.k2_in = dict(core=ranks[r]["core"].clone(), prefix=ranks[r]["prefix"].clone(),
                             blocks=ranks[r]["blocks"].clone())

    def after_k2(self, layer, key, ranks):
        for r, rec in enumerate(self.recs.pop(layer)):
            if not torch.equal(ranks[r]["out"], ranks[0]["out"]):
                raise RuntimeError(f"reference: K2 out differs between rank 0 and rank {r}")
            rec.k2_after = dict(prefix=ranks[r]["prefix"], out=ranks[r]["out"], blocks=ranks[r]["blocks"])
            self.written.append(cap.write_capture(self.out, rec, self.prod))

    def after_dense(self, layer, prefix, out):
        for rec in self.recs.pop(layer):
            rec.dense_after = dict(prefix=prefix, out=out)
            self.written.append(cap.write_capture(self.out, rec, self.prod))


class _Launches:
    """A backend made of two launch functions (e.g. a Recorder's wrappers of the reference's)."""

    def __init__(self, kda_pre, k2_launch):
        self.kda_pre, self.k2_launch = kda_pre, k2_launch
        self.name = "ref" if (kda_pre, k2_launch) == (ref.kda_pre, ref.k2_launch) else "launches"


def stack_layers(cfg: Config, layers) -> list[int]:
    """Consecutive layers of cfg ('a-b', a list, or None for every layer), else InputError."""
    if layers is None:
        layers = list(range(cfg.layers))
    layers = parse_layers(layers, cfg) if isinstance(layers, str) else list(layers)
    if not layers or layers != list(range(layers[0], layers[0] + len(layers))) or layers[-1] >= cfg.layers:
        raise InputError("layers", f"{layers} is not a stack of consecutive layers of {cfg.name}")
    return layers


def batch_shape(num_spec: int, requests: int | None, padding: int | None) -> tuple[int, int, int]:
    """(L, R, padding rows): R defaults to max(1, 8 // L) so S = R·L ≤ 8; padding to 1 when R ≥ 2."""
    L = num_spec + 1
    R = requests if requests is not None else max(1, 8 // L)
    return L, R, padding if padding is not None else (1 if R >= 2 else 0)


def synthesize(config: str | Config, layers, steps: int, num_spec: int, experts: str, seed: int, out,
               requests: int | None = None, padding: int | None = None, world: int | None = None,
               device="cpu", progress: bool = True, num_acc=None, git: bool = True,
               tool: str = TOOL, kda_pre=None, k2_launch=None, accept: str = "random",
               lifetime: int = 0, weights: str = "recipe", after: bool | None = None) -> list[Path]:
    """Run the reference over `layers` (consecutive; 'a-b', a list, or None for every layer) for
    `steps` decode steps; write one capture per (step, layer, rank) under `out`. Returns the
    capture-set folders, in order.

    requests (R): default max(1, 8 // L) so S = R·L ≤ 8; padding: default 1 when R ≥ 2;
    world: re-split the config for another TP size; num_acc: optional [steps][R] acceptance;
    accept / lifetime: the request mix (`RequestMix`); kda_pre / k2_launch: the launches to drive
    (default the reference; e.g. a Recorder's); weights: how captures name the weights, "recipe"
    (regenerated at replay, a few hundred bytes) or "stored" (files under out/weights); after:
    store what the launches wrote (default: yes, except for the k3-* presets, whose replays
    recompute it).
    """
    if weights not in WEIGHT_SOURCES:
        raise InputError("weights", f"{weights!r} is not one of {', '.join(WEIGHT_SOURCES)}")
    backend = _Launches(kda_pre or ref.kda_pre, k2_launch or ref.k2_launch)
    cfg = config if isinstance(config, Config) else get_config(config)
    if world is not None and world != cfg.world:
        try:
            cfg = cfg.with_world(world)
        except ValueError as e:
            raise InputError("world", str(e)) from None
    layers = stack_layers(cfg, layers)
    L, R, pad = batch_shape(num_spec, requests, padding)
    check_args(cfg, steps, num_spec, experts, R, pad, num_acc)
    if after is None:
        after = not cfg.name.startswith("k3")
    out = Path(out)
    targets = [cap.capture_path(out, t, i, r) for t in range(steps) for i in layers for r in range(cfg.world)]
    clash = [p for p in targets if p.exists()]
    if clash:
        raise InputError("out", f"{len(clash)} capture(s) already exist (first: {clash[0]}); nothing written")

    S = R * L
    state_len = cfg.conv - 2 + L  # vLLM: W - 1 + num_spec
    mix = RequestMix(R, L, pad, steps, seed, accept=accept, lifetime=lifetime, num_acc=num_acc)
    total = mix.total
    prod = cap.producer(tool, device, git=git)
    meta = {"synth": {"seed": seed, "requests": R, "padding": pad, "num_spec": num_spec, "steps": steps,
                      "layers": [layers[0], layers[-1]]}}
    if accept != "random" or lifetime:
        meta["synth"].update(accept=accept, lifetime=lifetime)
    out.mkdir(parents=True, exist_ok=True)

    from tqdm import tqdm

    bar = tqdm(total=steps * len(layers), desc=f"synth {cfg.name}", unit="layer-step", file=sys.stderr,
               disable=not progress, leave=False)
    dev = torch.device(device)
    source, weights = weights, {}
    for i in layers:
        bar.set_postfix_str(f"weights of layer {i}")
        weights[i] = _Weights(out, cfg, i, experts, seed, dev, source)
    caches = [layer_caches(cfg, i, total, state_len, seed, "synth-caches", dev) if cfg.has_k1(i) else None
              for i in layers]
    rec = _Recorder(out, cfg, experts, meta, prod, weights, total, after)
    stack = Stack.build(cfg, layers, backend, [weights[i].weights for i in layers], caches=caches, fmt=experts,
                        num_spec=num_spec, observer=rec)
    bar.set_postfix_str("")
    for t in range(steps):
        ms = mix.step()
        g = rsynth.gen("cpu", seed, "synth-step", t)
        prefix, blocks, delta = rsynth.carry(cfg, S, layers[0], g, "cpu", with_delta=layers[0] > 0)
        if layers[0] == 0:
            prefix = blocks[:, 0].clone()  # layer 0: the prefix is the embedding itself
        prefix, blocks = prefix.to(dev), blocks.to(dev)
        delta = None if delta is None else delta.to(dev)
        rec.begin(t, ms.st_idx, ms.num_acc, L)
        step = SpecStep(ms.st_idx.to(dev), ms.num_acc.to(dev), L, ms.fresh)
        stack.launch(step, prefix, blocks, delta, each=lambda *_: bar.update(1))
    bar.close()
    return list(dict.fromkeys(p.parent for p in rec.written))


class _Parser(argparse.ArgumentParser):
    """argparse that raises InputError (one line, exit 2 from the CLI) instead of printing usage."""

    def error(self, message):
        raise InputError("arguments", message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="k3verify synth", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--layers", default="0-5", help="consecutive layers, 'a-b' or 'a' (0-based)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--num-spec", type=int, default=3, help="speculative tokens; L = num_spec + 1")
    p.add_argument("--experts", default="mxfp4", help=f"expert format: {', '.join(EXPERT_FORMATS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=None, help="R (default: max(1, 8 // L), so S ≤ 8)")
    p.add_argument("--padding", type=int, default=None, help="padding requests among R (default: 1 if R ≥ 2)")
    p.add_argument("--world", type=int, default=None, help="TP size (default: the preset's)")
    p.add_argument("--accept", default="random", help=f"acceptance: {' | '.join(ACCEPT_MODES)}")
    p.add_argument("--lifetime", type=int, default=0,
                   help="mean request lifetime in steps: requests join and leave (default 0: they stay)")
    p.add_argument("--weights", default="recipe", choices=WEIGHT_SOURCES,
                   help="how captures name the weights: recipe (regenerated at replay) or stored files")
    p.add_argument("--after", default="auto", choices=("auto", "yes", "no"),
                   help="store what the launches wrote (auto: yes except for the k3-* presets)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-git", action="store_true", help="do not record the git revision")
    p.add_argument("--out", required=True)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def cli(argv) -> int:
    a = build_parser().parse_args(argv)
    try:
        cfg = get_config(a.config)
    except ValueError as e:
        raise InputError("config", str(e).split(": ", 1)[-1]) from None
    sets = synthesize(cfg, a.layers, a.steps, a.num_spec, a.experts, a.seed, a.out, requests=a.requests,
                      padding=a.padding, world=a.world, device=a.device, progress=not a.quiet, git=not a.no_git,
                      accept=a.accept, lifetime=a.lifetime, weights=a.weights,
                      after={"auto": None, "yes": True, "no": False}[a.after])
    n = sum(1 for s in sets for _ in s.glob("rank*.safetensors"))
    print(f"synth: wrote {n} captures in {len(sets)} sets under {a.out}")
    return 0
