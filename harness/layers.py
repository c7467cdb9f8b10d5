"""Layer runners: the decoder layers of one TP world on the mono decode path, shaped like the
seed's runtime layer (tests/standin/k3_runtime.py, after vLLM's `MonoKda` / `MonoK2`). This is
the one composition of the layer flow (DESIGN §3): `harness.synth` drives it to write captures,
`harness.drift` drives three copies of it closed-loop.

    weights = [layer_weights(cfg, i, fmt, seed) for i in layers]      # once per (layer, rank)
    stack = Stack.build(cfg, layers, backend, weights, num_spec=3, slots=17, fmt="mxfp4")
    stack.compile(width=8)                  # backend.compile_build(key) per build, if it has one
    for t in steps:
        prefix, blocks, out = stack.launch(SpecStep(st_idx, num_acc, qlen=4), prefix, blocks, None)

Runners:

- `WholeLayer` (a KDA layer): K1 on every rank (rank-local heads, replicated carry), then K2 on
  K1's `core_out` (`reset` and a fresh prefix buffer on a block-write layer);
- `DenseLayer` (layer 0): K1, then the dense MLP's stand-in (`dense_mlp`); no K2;
- `FfnLayer` (an MLA layer): vLLM's AttnRes op (K1 steps 1–3, `attnres_op`) and the MLA stand-in
  (`core = bf16(x @ mla_proj^T)` per rank), then K2.

Each takes a backend (the DESIGN §6 contract: `kda_pre`, `k2_launch`; `fast.ref_backend` is the
reference) and a rank `World`. `launch(step, prefix_sum, block_residual, prefix_delta)` returns
the carry `(prefix_sum, block_residual, out)` (rank 0's; `out` is the next layer's pending
delta) and never modifies its arguments. A runner owns its conv and recurrent caches (one pair
per rank; `caches()` gives the dim-first view the launch takes). `mode="oracle"` (reference
only) runs float64 state and activations without bf16 roundings; `perturb=seed` (reference
only) permutes its reduction orders. The stand-ins outside the fused path (dense MLP, AttnRes op,
MLA) are the reference's, exact or oracle with the runner.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import ref
from ref import synth as rsynth
from ref._num import Num
from ref.attnres import attnres, sources
from ref.comm import ordered_sum
from ref.config import Config, k1_build, k2_build
from ref.norms import rmsnorm
from ref.o_proj import o_proj_partial

from . import capture as cap

BF16, F64 = torch.bfloat16, torch.float64
ATTN_RES = ("ares_nw", "ares_qk", "in_nw")  # the AttnRes op's weights (K1 names), rank-replicated


@dataclass(frozen=True)
class World:
    """The TP ranks of one process: K1 runs rank by rank; K2's three reductions meet in a
    simulated collective (`ref.comm.SimWorld`, one thread per rank, rank-order fp32 sums)."""

    size: int

    def k2(self, key, ranks: list[dict], launch, **kw) -> None:
        ref.k2_world(key, ranks, launch=launch, **kw)


@dataclass
class SpecStep:
    """One spec-verify step's metadata (vLLM's attention metadata): st_idx [R, ≥L] int32 and
    num_acc [R] int32 on the launch device, L = qlen; `fresh`: slot ids of requests joining this
    step, zeroed in every cache before the launch."""

    st_idx: torch.Tensor
    num_acc: torch.Tensor
    qlen: int
    fresh: tuple[int, ...] = ()


@dataclass
class LayerWeights:
    """One layer's weights, one dict per rank (launch ABI names), shared read-only by every runner
    of the layer. k1: K1 weights (KDA/dense); k2: K2 weights (KDA/MLA); attn_res: the AttnRes op's
    norms (MLA, replicated); mla: [P, H] stand-in projections (MLA); dense: the dense MLP stand-in's
    weights (`ref.synth.dense_weights`)."""

    kind: str
    k1: list[dict] | None = None
    k2: list[dict] | None = None
    attn_res: dict | None = None
    mla: list[torch.Tensor] | None = None
    dense: list[dict] | None = None


def layer_weights(cfg: Config, layer: int, fmt: str, seed: int, device="cpu") -> LayerWeights:
    """Synthetic weights of one layer on every rank of cfg.world (`ref.synth`)."""
    kind = cfg.kind(layer)
    w = LayerWeights(kind)
    if kind == "mla":
        w.attn_res = {n: t for n, t in rsynth.k1_weights(cfg, layer, 0, seed, device).items() if n in ATTN_RES}
        w.mla = [rsynth.mla_proj(cfg, layer, r, seed, device) for r in range(cfg.world)]
    else:
        w.k1 = [rsynth.k1_weights(cfg, layer, r, seed, device) for r in range(cfg.world)]
    if kind == "dense":
        w.dense = [rsynth.dense_weights(cfg, layer, r, seed, device) for r in range(cfg.world)]
    else:
        w.k2 = [{"w13s": None, "w2s": None, **rsynth.k2_weights(cfg, layer, r, fmt, seed, device)}
                for r in range(cfg.world)]
    return w


def layer_caches(cfg: Config, layer: int, slots: int, state_len: int, seed: int, tag: str, device="cpu"):
    """Per rank (conv_state [slots, QKV, SL] bf16, rstate [slots, NH, HD, HD] fp32): `ref.synth.caches`
    drawn on the CPU from (seed, tag, layer, rank), the state a request's prefill left."""
    out = []
    for r in range(cfg.world):
        cs, rs = rsynth.caches(cfg, slots, state_len, rsynth.gen("cpu", seed, tag, layer, r), "cpu")
        out.append((cs.to(device), rs.to(device)))
    return out


class Observer:
    """Hooks around the launches (synth records captures here). args: a rank's launch keywords
    (tensors as the kernel sees them: before = inputs, after = in-place outputs written)."""

    def before_k1(self, layer: int, rank: int, key, args: dict) -> None: ...

    def after_k1(self, layer: int, rank: int, key, args: dict) -> None: ...

    def before_k2(self, layer: int, key, ranks: list[dict]) -> None: ...

    def after_k2(self, layer: int, key, ranks: list[dict]) -> None: ...

    def after_dense(self, layer: int, prefix: torch.Tensor, out: torch.Tensor) -> None: ...


_QUIET = Observer()


# ----------------------------------------------------------------------------- stand-ins

def attnres_op(prefix, delta, blocks, w: dict, cfg: Config, layer: int, num: Num) -> torch.Tensor:
    """vLLM's AttnRes op before an MLA attention = K1 steps 1–3 (pending delta add, block write,
    AttnRes, input norm). In place on prefix/blocks; returns x [S, H] (bf16 / f64 oracle)."""
    if delta is not None:
        prefix.copy_(num.bf(num.f(prefix) + num.f(delta)))
    wi = cfg.write_idx(layer)
    if wi >= 0:
        blocks[:, wi] = prefix
    mixed = attnres(sources(blocks, cfg.k1_nblocks(layer), prefix), w["ares_nw"], w["ares_qk"], cfg.eps, num)
    return rmsnorm(mixed, w["in_nw"], cfg.norm_eps("out_eps"), num)


def dense_mlp(cfg: Config, layer: int, cores, prefix, blocks, w, num: Num) -> torch.Tensor:
    """The dense layer after K1 (outside the fused path, DESIGN §3): o_proj and its rank-order
    all-reduce, the prefix update, the MLP AttnRes and post-attention norm, then a fixed random
    projection standing in for the dense SiTU MLP. prefix [S, H] is updated in place; returns the
    MLP output [S, H] (the next layer's pending delta). w: per-rank `ref.synth.dense_weights`."""
    delta = num.bf(ordered_sum([o_proj_partial(c, wr["w_o"], num) for c, wr in zip(cores, w)]))
    prefix.copy_(delta if cfg.is_block_write(layer) else num.bf(num.f(prefix) + num.f(delta)))
    mixed = attnres(sources(blocks, cfg.k2_nblocks(layer), prefix), w[0]["ares_nw"], w[0]["ares_qk"],
                    cfg.norm_eps("mlp_eps"), num)
    x = rmsnorm(mixed, w[0]["in_nw"], cfg.norm_eps("mlp_out_eps"), num)
    # one rounding after the fp32 GEMM, as a projection's output
    return num.bf(num.mm(x, w[0]["w_dense"]))


# ----------------------------------------------------------------------------- runners

class _Layer:
    """What every runner shares: its config slice, backend, world, weights, mode and hooks."""

    has_k1 = False
    has_k2 = False

    def __init__(self, cfg: Config, layer: int, backend, world: World, weights: LayerWeights, *, fmt: str,
                 num_spec: int, caches=None, mode: str = "exact", perturb: int | None = None,
                 conv_layout: str = "DS", taps: tuple[str, ...] = (), keep_k2_inputs: bool = False,
                 observer: Observer | None = None):
        if weights.kind != cfg.kind(layer):
            raise ValueError(f"layer {layer}: weights of a {weights.kind} layer for a {cfg.kind(layer)} layer")
        if (mode != "exact" or perturb is not None) and getattr(backend, "name", None) != "ref":
            raise ValueError(f"mode={mode!r} / perturb={perturb!r}: only the reference backend runs them")
        self.cfg, self.layer, self.backend, self.world, self.w = cfg, layer, backend, world, weights
        self.fmt, self.L, self.mode, self.perturb = fmt, num_spec + 1, mode, perturb
        self.kind = cfg.kind(layer)
        self.state_len = cfg.conv - 2 + self.L  # vLLM: W - 1 + num_spec
        self.dtype = F64 if mode == "oracle" else BF16
        self.num = Num(mode)  # the stand-ins: vLLM's own ops, never perturbed
        self.kw = {k: v for k, v in (("mode", mode if mode != "exact" else None), ("perturb", perturb))
                   if v is not None}
        self.taps = set(taps)
        self.last_taps: dict[str, list[dict]] = {}
        self.keep_k2_inputs = keep_k2_inputs
        self._k2_saved = None
        self.obs = observer or _QUIET
        self.outs: list[torch.Tensor] = []  # every rank's `out` of the last launch
        self.cores: list[torch.Tensor] = []  # every rank's K1 `core_out` of the last launch
        self._caches = None
        if self.has_k1:
            if caches is None or len(caches) != world.size:
                raise ValueError(f"layer {layer}: needs one (conv_state, rstate) pair per rank")
            if conv_layout not in ("DS", "SD"):
                raise ValueError(f"conv_layout: {conv_layout!r} not DS (dim-first) or SD (vLLM's default)")
            self._caches = [(self._conv_buffer(c, conv_layout), s.to(F64 if mode == "oracle" else s.dtype, copy=True))
                            for c, s in caches]

    def _conv_buffer(self, c: torch.Tensor, layout: str) -> torch.Tensor:
        """A private conv cache from c [slots, QKV, SL], held as vLLM lays it out ("SD": a
        [slots, SL, QKV] buffer; "DS": [slots, QKV, SL]) and kept as the dim-first view of it."""
        dt = F64 if self.mode == "oracle" else c.dtype
        if layout == "DS":
            return c.to(dt, copy=True).contiguous()
        return c.transpose(1, 2).to(dt, copy=True).contiguous().transpose(1, 2)

    # -- the runtime layer's surface

    @property
    def is_block_write(self) -> bool:
        return self.cfg.is_block_write(self.layer)

    def caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per rank (conv_state as the dim-first [slots, QKV, state_len] view, rstate [slots, NH, HD, HD])."""
        return list(self._caches or [])

    def builds(self, width: int) -> list:
        """Build keys this layer launches at `width` token rows (K1 with a pending delta on every
        layer but 0, whose prefix is the embedding; K2 where there is one)."""
        out = []
        if self.has_k1:
            out.append(k1_build(self.cfg, self.layer, width, self.L, self.layer > 0, self.state_len))
        if self.has_k2:
            out.append(k2_build(self.cfg, self.layer, width, self.fmt))
        return out

    def attention(self, step: SpecStep, prefix_sum, block_residual, prefix_delta):
        """The attention side (K1, or the AttnRes op and MLA) -> (cores per rank, prefix, blocks)."""
        raise NotImplementedError

    def mlp(self, cores, prefix, blocks, *, force_ids=None):
        """The MLP side (K2, or the dense stand-in) on the attention side's results (not modified)
        -> the carry (prefix, blocks, out). force_ids: per-rank [S, K] picks (reference only)."""
        raise NotImplementedError

    def launch(self, step: SpecStep, prefix_sum, block_residual, prefix_delta, *, force_ids=None):
        """The whole layer -> (prefix_sum, block_residual, out); the arguments are not modified."""
        return self.mlp(*self.attention(step, prefix_sum, block_residual, prefix_delta), force_ids=force_ids)

    # -- shared pieces

    def _weights(self, w: dict) -> dict:
        return w  # stored dtypes in both modes: the oracle upcasts each weight exactly at use

    def _carry(self, prefix, blocks, delta):
        as_ = lambda t: None if t is None else t.to(self.dtype)  # noqa: E731 - bf16 stays itself
        return as_(prefix), as_(blocks), as_(delta)

    def _mlp_in(self, cores, prefix, blocks):
        """The MLP side's own copies in its dtype: a fresh prefix buffer (K2 updates it in place)."""
        cores = [c.to(self.dtype) for c in cores]
        return cores, prefix.to(self.dtype, copy=True), blocks.to(self.dtype)

    def _zero_fresh(self, step: SpecStep) -> None:
        if step.fresh and self._caches is not None:
            idx = torch.tensor(step.fresh, dtype=torch.long, device=self._caches[0][1].device)
            for c, s in self._caches:
                c.index_fill_(0, idx, 0)
                s.index_fill_(0, idx, 0)

    def _k1(self, step: SpecStep, prefix, blocks, delta):
        """K1 on every rank (each on copies of the replicated carry) -> (cores, rank 0's prefix, blocks)."""
        S = prefix.shape[0]
        key = k1_build(self.cfg, self.layer, S, step.qlen, delta is not None, self.state_len)
        cores, after = [], None
        want = "k1" in self.taps
        self.last_taps["k1"] = []
        for r, (conv, rs) in enumerate(self._caches):
            a = dict(prefix=prefix.clone(), delta=None if delta is None else delta.clone(), blocks=blocks.clone(),
                     conv_state=conv, rstate=rs, st_idx=step.st_idx, num_acc=step.num_acc,
                     core_out=cap.poison_(torch.empty(S, self.cfg.p, dtype=self.dtype, device=prefix.device)),
                     layer=self.layer)
            self.obs.before_k1(self.layer, r, key, a)
            t = {} if want else None
            self.backend.kda_pre(key, **a, **self._weights(self.w.k1[r]), **({"taps": t} if want else {}),
                                 **self.kw)
            self.last_taps["k1"].append(t)
            self.obs.after_k1(self.layer, r, key, a)
            cores.append(a["core_out"])
            if r == 0:
                after = a
        self.cores = cores
        return cores, after["prefix"], after["blocks"]

    def _k2(self, cores, prefix, blocks, force_ids=None) -> torch.Tensor:
        """K2 on every rank; prefix [S, H] is updated in place (rank 0's buffer). Returns rank 0's out."""
        S = prefix.shape[0]
        key = k2_build(self.cfg, self.layer, S, self.fmt)
        if self.keep_k2_inputs:
            self._k2_saved = ([c.clone() for c in cores], prefix.clone(), blocks)
        ranks = [dict(core=cores[r].clone(), prefix=prefix if r == 0 else prefix.clone(), blocks=blocks.clone(),
                      out=cap.poison_(torch.empty(S, self.cfg.hidden, dtype=self.dtype, device=prefix.device)),
                      layer=self.layer, **self._weights(self.w.k2[r]))
                 for r in range(self.world.size)]
        self.obs.before_k2(self.layer, key, ranks)
        if "k2" in self.taps:
            for a in ranks:
                a["taps"] = {}
        if force_ids is not None:
            for a, f in zip(ranks, force_ids):
                a["force_ids"] = f
        self.world.k2(key, ranks, self.backend.k2_launch, **self.kw)
        self.last_taps["k2"] = [a.pop("taps", None) for a in ranks]
        for a in ranks:
            a.pop("force_ids", None)
        self.obs.after_k2(self.layer, key, ranks)
        self.outs = [a["out"] for a in ranks]
        return ranks[0]["out"]

    def rerun_k2(self, force_ids) -> tuple:
        """K2 again on the inputs of the last launch with the routing forced to `force_ids` (per rank
        [S, K]; reference only, keep_k2_inputs=True). Returns the new carry like `launch`."""
        if self._k2_saved is None:
            raise RuntimeError(f"layer {self.layer}: no K2 inputs kept (keep_k2_inputs=True)")
        cores, prefix, blocks = self._k2_saved
        prefix = prefix.clone()
        out = self._k2(cores, prefix, blocks, force_ids)
        return prefix, blocks, out


class WholeLayer(_Layer):
    """A KDA layer: K1, then K2 on its core (a block-write layer: K2 resets the prefix to o_proj's
    output in a fresh buffer; K1's buffer is the bank row it stored)."""

    has_k1 = has_k2 = True

    def attention(self, step: SpecStep, prefix_sum, block_residual, prefix_delta):
        self._zero_fresh(step)
        return self._k1(step, *self._carry(prefix_sum, block_residual, prefix_delta))

    def mlp(self, cores, prefix, blocks, *, force_ids=None):
        cores, prefix, blocks = self._mlp_in(cores, prefix, blocks)
        # the fresh prefix buffer holds K1's values, not zeros: a K2 that wrongly reads it under
        # reset then shows
        out = self._k2(cores, prefix, blocks, force_ids)
        return prefix, blocks, out


class DenseLayer(_Layer):
    """Layer 0: K1, then the dense MLP's stand-in (vLLM's unfused dense layer); no K2."""

    has_k1 = True

    def attention(self, step: SpecStep, prefix_sum, block_residual, prefix_delta):
        self._zero_fresh(step)
        return self._k1(step, *self._carry(prefix_sum, block_residual, prefix_delta))

    def mlp(self, cores, prefix, blocks, *, force_ids=None):
        cores, prefix, blocks = self._mlp_in(cores, prefix, blocks)
        dense = [self._weights(w) for w in self.w.dense]
        out = dense_mlp(self.cfg, self.layer, cores, prefix, blocks, dense, self.num)
        self.obs.after_dense(self.layer, prefix, out)
        self.outs = [out] * self.world.size
        return prefix, blocks, out


class FfnLayer(_Layer):
    """An MLA layer: vLLM's AttnRes op and the MLA stand-in up to o_proj's input, then K2."""

    has_k2 = True

    def attention(self, step: SpecStep, prefix_sum, block_residual, prefix_delta):
        prefix, blocks, delta = self._carry(prefix_sum, block_residual, prefix_delta)
        prefix, blocks = prefix.clone(), blocks.clone()
        x = attnres_op(prefix, delta, blocks, self._weights(self.w.attn_res), self.cfg, self.layer, self.num)
        # o_proj input of the stand-in attention: one bf16 rounding after the fp32 GEMM
        cores = [self.num.bf(self.num.mm(x, p.to(self.dtype) if self.mode == "oracle" else p)) for p in self.w.mla]
        return cores, prefix, blocks

    def mlp(self, cores, prefix, blocks, *, force_ids=None):
        cores, prefix, blocks = self._mlp_in(cores, prefix, blocks)
        out = self._k2(cores, prefix, blocks, force_ids)
        return prefix, blocks, out


RUNNERS = {"kda": WholeLayer, "dense": DenseLayer, "mla": FfnLayer}


def make_layer(cfg: Config, layer: int, backend, world: World, weights: LayerWeights, **kw) -> _Layer:
    return RUNNERS[cfg.kind(layer)](cfg, layer, backend, world, weights, **kw)


@dataclass
class Stack:
    """A config's consecutive layers, run in order: each layer's carry is the next one's."""

    cfg: Config
    layers: list = field(default_factory=list)

    @classmethod
    def build(cls, cfg: Config, layers, backend, weights, *, caches=None, **kw) -> "Stack":
        """weights: one LayerWeights per layer (shared); caches: per layer a list of per-rank
        (conv_state, rstate) for K1 layers (None otherwise). kw: the runners' options."""
        world = World(cfg.world)
        caches = caches or [None] * len(layers)
        return cls(cfg, [make_layer(cfg, i, backend, world, w, caches=c, **kw)
                         for i, w, c in zip(layers, weights, caches)])

    def builds(self, width: int) -> list:
        return list(dict.fromkeys(k for layer in self.layers for k in layer.builds(width)))

    def compile(self, width: int) -> int:
        """Compile every build ahead with the backend's `compile_build(key)`, when it has one.
        Returns the number of builds compiled."""
        fn = getattr(self.layers[0].backend, "compile_build", None) if self.layers else None
        if fn is None:
            return 0
        keys = self.builds(width)
        for k in keys:
            fn(k)
        return len(keys)

    def launch(self, step: SpecStep, prefix_sum, block_residual, prefix_delta, each=None):
        """Every layer in order; `each(runner, carry)` after each one. Returns the last carry."""
        carry = (prefix_sum, block_residual)
        delta = prefix_delta
        for layer in self.layers:
            p, b, delta = layer.launch(step, carry[0], carry[1], delta)
            carry = (p, b)
            if each is not None:
                each(layer, (p, b, delta))
        return carry[0], carry[1], delta


__all__ = ["World", "SpecStep", "LayerWeights", "layer_weights", "layer_caches", "Observer", "WholeLayer",
           "DenseLayer", "FfnLayer", "RUNNERS", "make_layer", "Stack", "attnres_op", "dense_mlp"]
