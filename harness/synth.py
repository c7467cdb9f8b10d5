"""`k3verify synth`: synthetic captures from a reference run over a stack of layers (DESIGN §8).

    k3verify synth --config tiny --layers 0-5 --steps 8 --num-spec 3 --experts mxfp4 --seed 0 --out DIR

Per decode step, fresh token rows enter the first layer (AttnRes carry from
`ref.synth.carry`; at layer 0 the prefix is the embedding and there is no pending
delta) and flow through every layer of the stack:

- KDA layer: `ref.kda_pre` on every rank (rank-local heads, replicated carry), then
  `ref.k2_world` on K1's `core_out`;
- dense layer (layer 0): `ref.kda_pre`, then the dense MLP's stand-in (`dense_mlp`: o_proj
  all-reduce, prefix update, MLP AttnRes + norm, a fixed random projection); no K2;
- MLA layer: the reference's K1 steps 1–3 (pending delta add, block write, AttnRes,
  input norm) stand in for vLLM's AttnRes op, then `core = bf16(x @ mla_proj^T)` per
  rank (`ref.synth.mla_proj`), then `ref.k2_world`;
- K2's `out` is the next layer's pending delta; K1's block write and K2's reset follow
  the config's block schedule (`k1_build` / `k2_build`).

Speculative decoding: R requests of L = num_spec + 1 tokens; each real request owns L
slots of a cache with twice as many slots as referenced (random ids, slot 0 the null
slot), the same every step, so step t+1 with acceptance a starts from slot
st_idx[r, a-1], exactly where step t wrote the state after its a-th token. The last
`padding` requests are padding (null slots, alternately 0 and -1). Acceptance counts
are random in 1..L unless given. Every random draw comes from a generator seeded by
(seed, what it is for): the same command writes the same bytes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import ref
from ref import synth as rsynth
from ref._num import Num
from ref.attnres import attnres, sources
from ref.config import EXPERT_FORMATS, PRESETS, Config, get_config, k1_build, k2_build
from ref.norms import rmsnorm

from . import capture as cap
from .errors import InputError

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


def _check_args(cfg: Config, steps: int, num_spec: int, experts: str, requests: int, padding: int,
                num_acc) -> None:
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


def _mla_pre(prefix, delta, blocks, w, layer: int, cfg: Config, num: Num):
    """vLLM's AttnRes op before MLA = K1 steps 1–3. In place on prefix/blocks; returns x [S, H] bf16."""
    if delta is not None:
        prefix.copy_(num.bf(num.f(prefix) + num.f(delta)))
    wi = cfg.write_idx(layer)
    if wi >= 0:
        blocks[:, wi] = prefix
    mixed = attnres(sources(blocks, cfg.k1_nblocks(layer), prefix), w["ares_nw"], w["ares_qk"], cfg.eps, num)
    return rmsnorm(mixed, w["in_nw"], cfg.norm_eps("out_eps"), num)


def dense_mlp(cfg: Config, layer: int, cores, prefix, blocks, w, num: Num):
    """The dense layer after K1 (outside the fused path, DESIGN §3): o_proj and its rank-order
    all-reduce, the prefix update, the MLP AttnRes and post-attention norm, then a fixed random
    projection standing in for the dense SiTU MLP. prefix is updated in place; returns the MLP
    output (the next layer's pending delta). w: per-rank `ref.synth.dense_weights`."""
    from ref.comm import ordered_sum
    from ref.o_proj import o_proj_partial

    delta = num.bf(ordered_sum([o_proj_partial(c, wr["w_o"], num) for c, wr in zip(cores, w)]))
    prefix.copy_(delta if cfg.is_block_write(layer) else num.bf(num.f(prefix) + num.f(delta)))
    mixed = attnres(sources(blocks, cfg.k2_nblocks(layer), prefix), w[0]["ares_nw"], w[0]["ares_qk"],
                    cfg.norm_eps("mlp_eps"), num)
    x = rmsnorm(mixed, w[0]["in_nw"], cfg.norm_eps("mlp_out_eps"), num)
    # one rounding after the fp32 GEMM, as a projection's output
    return num.bf(num.mm(x, w[0]["w_dense"]))


class _LayerState:
    """One layer's per-rank weights (stored once, then used memory-mapped) and caches."""

    def __init__(self, root: Path, cfg: Config, layer: int, fmt: str, seed: int, device, total_slots: int,
                 state_len: int):
        self.kind = cfg.kind(layer)
        self.k1, self.k2, self.addr1, self.addr2, self.mla, self.conv, self.rstate = ([] for _ in range(7))
        self.dense = []
        for r in range(cfg.world):
            w1 = rsynth.k1_weights(cfg, layer, r, seed, device)
            if self.kind in cap.K1_KINDS:
                self.addr1.append(cap.store_weights(root, w1))
                self.k1.append(self._mapped(root, self.addr1[-1], device))
                g = rsynth.gen("cpu", seed, "synth-caches", layer, r)
                cs, rs = rsynth.caches(cfg, total_slots, state_len, g, "cpu")
                self.conv.append(cs.to(device))
                self.rstate.append(rs.to(device))
            else:
                self.k1.append({n: w1[n] for n in ("ares_nw", "ares_qk", "in_nw")})
                self.mla.append(rsynth.mla_proj(cfg, layer, r, seed, device))
            del w1
            if self.kind == "dense":
                self.dense.append(rsynth.dense_weights(cfg, layer, r, seed, device))
                continue
            w2 = rsynth.k2_weights(cfg, layer, r, fmt, seed, device)
            self.addr2.append(cap.store_weights(root, w2))
            del w2
            self.k2.append({"w13s": None, "w2s": None, **self._mapped(root, self.addr2[-1], device)})

    @staticmethod
    def _mapped(root: Path, addr: str, device) -> dict:
        w = cap.load_weights(Path(root) / "weights" / f"{addr}.safetensors", verify=False)
        return w if torch.device(device).type == "cpu" else {n: t.to(device) for n, t in w.items()}


def synthesize(config: str | Config, layers, steps: int, num_spec: int, experts: str, seed: int, out,
               requests: int | None = None, padding: int | None = None, world: int | None = None,
               device="cpu", progress: bool = True, num_acc=None, git: bool = True,
               tool: str = TOOL, kda_pre=None, k2_launch=None) -> list[Path]:
    """Run the reference over `layers` (consecutive; 'a-b', a list, or None for every layer) for
    `steps` decode steps; write one capture per (step, layer, rank) under `out`. Returns the
    capture-set folders, in order.

    requests (R): default max(1, 8 // L) so S = R·L ≤ 8; padding: default 1 when R ≥ 2;
    world: re-split the config for another TP size; num_acc: optional [steps][R] acceptance;
    kda_pre / k2_launch: the launches to drive (default the reference; e.g. a Recorder's).
    """
    kda_pre = kda_pre or ref.kda_pre
    cfg = config if isinstance(config, Config) else get_config(config)
    if world is not None and world != cfg.world:
        try:
            cfg = cfg.with_world(world)
        except ValueError as e:
            raise InputError("world", str(e)) from None
    if layers is None:
        layers = list(range(cfg.layers))
    layers = parse_layers(layers, cfg) if isinstance(layers, str) else list(layers)
    if not layers or layers != list(range(layers[0], layers[0] + len(layers))) or layers[-1] >= cfg.layers:
        raise InputError("layers", f"{layers} is not a stack of consecutive layers of {cfg.name}")
    L = num_spec + 1
    R = requests if requests is not None else max(1, 8 // L)
    pad = padding if padding is not None else (1 if R >= 2 else 0)
    _check_args(cfg, steps, num_spec, experts, R, pad, num_acc)
    out = Path(out)
    targets = [cap.capture_path(out, t, i, r) for t in range(steps) for i in layers for r in range(cfg.world)]
    clash = [p for p in targets if p.exists()]
    if clash:
        raise InputError("out", f"{len(clash)} capture(s) already exist (first: {clash[0]}); nothing written")

    S, W = R * L, cfg.conv
    state_len = W - 2 + L  # vLLM: W - 1 + num_spec
    st_idx, total = slot_plan(R, L, pad, rsynth.gen("cpu", seed, "synth-slots"))
    smap = cap.slot_map_for(st_idx, L)
    prod = cap.producer(tool, device, git=git)
    meta = {"synth": {"seed": seed, "requests": R, "padding": pad, "num_spec": num_spec, "steps": steps,
                      "layers": [layers[0], layers[-1]]}}
    out.mkdir(parents=True, exist_ok=True)

    from tqdm import tqdm

    bar = tqdm(total=steps * len(layers), desc=f"synth {cfg.name}", unit="layer-step", file=sys.stderr,
               disable=not progress, leave=False)
    state: dict[int, _LayerState] = {}
    num = Num("exact")
    written: list[Path] = []
    dev = torch.device(device)
    for t in range(steps):
        g = rsynth.gen("cpu", seed, "synth-step", t)
        na = (torch.tensor(num_acc[t], dtype=torch.int32) if num_acc is not None
              else torch.randint(1, L + 1, (R,), generator=g, dtype=torch.int32))
        prefix, blocks, delta = rsynth.carry(cfg, S, layers[0], g, "cpu", with_delta=layers[0] > 0)
        if layers[0] == 0:
            prefix = blocks[:, 0].clone()  # layer 0: the prefix is the embedding itself
        prefix, blocks = prefix.to(dev), blocks.to(dev)
        delta = None if delta is None else delta.to(dev)
        for i in layers:
            if i not in state:
                bar.set_postfix_str(f"weights of layer {i}")
                state[i] = _LayerState(out, cfg, i, experts, seed, dev, total, state_len)
            ls = state[i]
            k2key = None if ls.kind == "dense" else k2_build(cfg, i, S, experts)
            recs = [cap.StepRecord(step=t, layer=i, rank=r, world=cfg.world, kind=ls.kind, fmt=experts,
                                   k2_key=k2key, k2_in=None, k2_weights=ls.addr2[r] if ls.addr2 else None, cfg=cfg,
                                   meta=meta)
                    for r in range(cfg.world)]
            if ls.kind in cap.K1_KINDS:
                k1key = k1_build(cfg, i, S, L, delta is not None, state_len)
                cores = []
                for r, rec in enumerate(recs):
                    a = dict(prefix=prefix.clone(), delta=None if delta is None else delta.clone(),
                             blocks=blocks.clone(), conv_state=ls.conv[r], rstate=ls.rstate[r],
                             st_idx=st_idx.to(dev), num_acc=na.to(dev),
                             core_out=cap.poison_(torch.empty(S, cfg.p, dtype=BF16, device=dev)), layer=i)
                    rec.k1_in = dict(prefix=a["prefix"].clone(), delta=delta, blocks=a["blocks"].clone(),
                                     conv_state=cap.compact_cache(a["conv_state"], smap),
                                     rstate=cap.compact_cache(a["rstate"], smap), st_idx=st_idx, num_acc=na)
                    kda_pre(k1key, **a, **ls.k1[r])
                    rec.k1_after = dict(prefix=a["prefix"], blocks=a["blocks"],
                                        conv_state=cap.compact_cache(a["conv_state"], smap),
                                        rstate=cap.compact_cache(a["rstate"], smap), core_out=a["core_out"])
                    rec.k1_key, rec.k1_weights = k1key, ls.addr1[r]
                    rec.slot_map, rec.conv_slots, rec.rec_slots = smap, total, total
                    rec.conv_layout = cap.conv_layout_of(ls.conv[r])
                    cores.append(a["core_out"])
                prefix, blocks = recs[0].k1_after["prefix"], recs[0].k1_after["blocks"]
            else:
                x = _mla_pre(prefix, delta, blocks, ls.k1[0], i, cfg, num)
                # o_proj input of the stand-in attention: one bf16 rounding after the fp32 GEMM
                cores = [num.bf(num.mm(x, ls.mla[r])) for r in range(cfg.world)]
            if ls.kind == "dense":
                prefix = prefix.clone()
                mlp_out = dense_mlp(cfg, i, cores, prefix, blocks, ls.dense, num)
                for rec in recs:
                    rec.dense_after = dict(prefix=prefix, out=mlp_out)
                    written.append(cap.write_capture(out, rec, prod))
                delta = mlp_out
                bar.update(1)
                continue
            ranks = [dict(core=cores[r].clone(), prefix=prefix.clone(), blocks=blocks.clone(),
                          out=cap.poison_(torch.empty(S, cfg.hidden, dtype=BF16, device=dev)), layer=i, **ls.k2[r])
                     for r in range(cfg.world)]
            for r, rec in enumerate(recs):
                rec.k2_in = dict(core=cores[r], prefix=prefix.clone(), blocks=blocks.clone())
            ref.k2_world(k2key, ranks, launch=k2_launch)
            for r, rec in enumerate(recs):
                if not torch.equal(ranks[r]["out"], ranks[0]["out"]):
                    raise RuntimeError(f"reference: K2 out differs between rank 0 and rank {r}")
                rec.k2_after = dict(prefix=ranks[r]["prefix"], out=ranks[r]["out"], blocks=ranks[r]["blocks"])
                written.append(cap.write_capture(out, rec, prod))
            prefix, delta = ranks[0]["prefix"].clone(), ranks[0]["out"].clone()
            bar.update(1)
    bar.close()
    return list(dict.fromkeys(p.parent for p in written))


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
                      padding=a.padding, world=a.world, device=a.device, progress=not a.quiet, git=not a.no_git)
    n = sum(1 for s in sets for _ in s.glob("rank*.safetensors"))
    print(f"synth: wrote {n} captures in {len(sets)} sets under {a.out}")
    return 0
