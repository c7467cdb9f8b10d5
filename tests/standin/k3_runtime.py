"""Stand-in of the seed's runtime layer (DESIGN §12), a test fixture: the decoder layers of
one TP rank on the mono path, calling the launches through vLLM-shaped module paths as
the seed does (``kda.kda_pre(key, …, **runner.launch_args())``, ``k2.k2_launch(key, …,
**runner.launch_args(), **runner.peer_args())``), modelled on vLLM's `MonoKda` / `MonoK2`
(mono_decode.py@9c6c96d8):

- `WholeLayer` (a KDA layer): `_k1_key` from the layer's norms and block schedule, `builds`,
  `caches()` (vLLM's conv state is [slots, state_len, dim] unless the layout is dim-first:
  the launch gets the dim-first transposed view), `launch`: K1, then K2 (with `reset` and a
  fresh prefix buffer on a block-write layer). Layer 0 is dense (DESIGN §3): K1, then vLLM's
  dense MLP, no K2.
- `FfnLayer` (an MLA layer): vLLM's AttnRes op and MLA attention up to o_proj's input
  (the fixed random projection k3verify's synth uses), then K2.
- `_k2`: K2 of a layer, `w_up` narrowed to this rank's rows of the replicated weight.
- `compile_build`: a layer's builds compiled ahead (the stand-in kernels compile nothing).

Weights are the reference's synthetic ones (`ref.synth`), held under vLLM's module names in
the dtypes vLLM's mono path requires (`MonoKda.weights_ok`: conv1d.weight, A_log, dt_bias fp32).
`serve_world` runs a few decode steps of a tiny stack on every rank, one thread per rank
over a SimWorld (or `serve` in one torch.distributed process per rank).
"""
from __future__ import annotations

import os
from types import SimpleNamespace as NS

import torch

from ref import synth as rsynth
from ref._num import Num
from ref.attnres import attnres, sources
from ref.norms import rmsnorm
from ref.o_proj import o_proj_partial, reduce_bf

BF16 = torch.bfloat16


def _mods():
    """The launch modules, looked up at call time as vLLM does (a plugin may have wrapped them)."""
    from vllm.models.kimi_k3.amd.mono import layer as k2
    from vllm.models.kimi_k3.amd.mono import runner
    from vllm.models.kimi_k3.amd.mono.attention import kda

    return kda, k2, runner


def dim_first() -> bool:
    return os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "SD") == "DS"


def _norm(w, eps):
    return NS(weight=w, variance_epsilon=eps, eps=eps)


class _Layer:
    def __init__(self, cfg, idx: int, rank: int, seed: int):
        self.cfg, self.layer_idx, self.rank = cfg, idx, rank
        self.is_block_write_layer = cfg.is_block_write(idx)
        self.block_write_idx = idx // cfg.block_size
        self.prev_valid_blocks = cfg.prev_valid_blocks(idx)
        self.num = Num("exact")

    def _k2_key(self, s: int):
        _, k2, _ = _mods()
        reset = self.is_block_write_layer
        return k2.K2Build(tokens=s, nblocks=self.prev_valid_blocks + (1 if reset else 0), reset=reset,
                          eps=self.mlp_res_norm.variance_epsilon, out_eps=self.post_attention_layernorm.variance_epsilon,
                          ln_eps=self.mlp.routed_expert_norm.variance_epsilon)

    def _bind_moe(self, cfg, idx, rank, seed, fmt, world):
        w2 = rsynth.k2_weights(cfg, idx, rank, fmt, seed)
        up = torch.cat([w2["w_up"] if r == rank else rsynth.k2_weights(cfg, idx, r, fmt, seed)["w_up"]
                        for r in range(world)])  # routed_expert_up_proj is replicated: every rank's rows
        self.o_proj = NS(weight=w2["w_o"])
        self.mlp_res_norm = _norm(w2["ares_nw"], cfg.norm_eps("mlp_eps"))
        self.mlp_res_proj = NS(weight=w2["ares_qk"].view(1, cfg.hidden))
        self.post_attention_layernorm = _norm(w2["in_nw"], cfg.norm_eps("mlp_out_eps"))
        self.mlp = NS(gate=NS(weight=w2["w_gate"], e_score_correction_bias=w2["bias"]),
                      routed_expert_down_proj=NS(weight=w2["w_ld"]),
                      shared_experts=NS(gate_up_proj=NS(weight=w2["w_sgu"]), down_proj=NS(weight=w2["w_sd"])),
                      experts=NS(w13_weight=w2["w13"], w13_weight_scale=w2["w13s"], w2_weight=w2["w2"],
                                 w2_weight_scale=w2["w2s"]),
                      routed_expert_norm=_norm(w2["ln_w"], cfg.norm_eps("ln_eps")),
                      routed_expert_up_proj=NS(weight=up))

    def builds(self, s: int, L: int) -> list:
        """(module, key) of every build this layer launches at S = s rows of L tokens a request."""
        kda, k2, _ = _mods()
        out = []
        if hasattr(self, "self_attn") and hasattr(self.self_attn, "in_proj_qkvgfab"):
            out += [(kda, self._k1_key(s, L, d, self.self_attn.state_len)) for d in (False, True)]
        if hasattr(self, "mlp") and hasattr(self.mlp, "experts"):
            out.append((k2, self._k2_key(s)))
        return out


def _k2(layer: _Layer, core, prefix, blocks, reset: bool):
    """K2 of one layer: o_proj + all-reduce + MLP AttnRes + latent MoE (vLLM's MonoK2.forward)."""
    _, k2, runner = _mods()
    from vllm.models.kimi_k3.amd.mono.stages import moe

    m = layer.mlp
    w_up = m.routed_expert_up_proj.weight.narrow(0, layer.rank * moe.UP_N, moe.UP_N)
    out = torch.empty_like(prefix)
    k2.k2_launch(layer._k2_key(core.size(0)), core=core, w_o=layer.o_proj.weight, prefix=prefix, blocks=blocks,
                 ares_nw=layer.mlp_res_norm.weight, ares_qk=layer.mlp_res_proj.weight.view(layer.cfg.hidden),
                 in_nw=layer.post_attention_layernorm.weight, w_gate=m.gate.weight,
                 bias=m.gate.e_score_correction_bias, w_ld=m.routed_expert_down_proj.weight,
                 w_sgu=m.shared_experts.gate_up_proj.weight, w_sd=m.shared_experts.down_proj.weight,
                 w13=m.experts.w13_weight, w13s=m.experts.w13_weight_scale, w2=m.experts.w2_weight,
                 w2s=m.experts.w2_weight_scale, ln_w=m.routed_expert_norm.weight, w_up=w_up, out=out,
                 **runner.launch_args(), **runner.peer_args(), layer=128 + layer.layer_idx)
    return out


def compile_build(mod, key):
    """Compile one build ahead of serving (the warm-up a runtime does before the first step)."""
    return mod.build(key)


class WholeLayer(_Layer):
    """A KDA decoder layer: K1, then K2 (layer 0: K1, then the dense MLP)."""

    def __init__(self, cfg, idx: int, rank: int, world: int, seed: int, fmt: str, slots: int, state_len: int):
        super().__init__(cfg, idx, rank, seed)
        w1 = rsynth.k1_weights(cfg, idx, rank, seed)
        H, W = cfg.hidden, cfg.conv
        self.self_attention_res_norm = _norm(w1["ares_nw"], cfg.eps)
        self.self_attention_res_proj = NS(weight=w1["ares_qk"].view(1, H))
        self.input_layernorm = _norm(w1["in_nw"], cfg.norm_eps("out_eps"))
        g = rsynth.gen("cpu", seed, "standin-caches", idx, rank)
        conv, rs = rsynth.caches(cfg, slots, state_len, g)
        # vLLM's cache pages: conv state [slots, state_len, dim] ("SD") or [slots, dim, state_len]
        # ("DS"); the recurrent state's slots strided (a padded page a slot)
        conv_buf = conv.contiguous() if dim_first() else conv.transpose(1, 2).contiguous()
        page = torch.zeros(slots, cfg.nh * cfg.hd * cfg.hd + 64)
        rstate = page.as_strided((slots, cfg.nh, cfg.hd, cfg.hd), (page.stride(0), cfg.hd * cfg.hd, cfg.hd, 1))
        rstate.copy_(rs)
        self.self_attn = NS(in_proj_qkvgfab=NS(weight=w1["w_in"]), f_b_proj=NS(weight=w1["w_fb"]),
                            conv1d=NS(weight=w1["conv_w"].float().view(cfg.qkv, 1, W)),
                            A_log=w1["a_log"].float(), dt_bias=w1["dt_bias"].float(), o_norm=_norm(w1["on_w"], cfg.norm_eps("onorm_eps")),
                            gate_lower_bound=cfg.lower_bound, kv_cache=(conv_buf, rstate), state_len=state_len)
        self.dense = None
        if cfg.is_dense(idx):
            self.dense = rsynth.dense_weights(cfg, idx, rank, seed)
        else:
            self._bind_moe(cfg, idx, rank, seed, fmt, world)

    def _k1_key(self, s: int, L: int, delta: bool, state_len: int):
        kda, _, _ = _mods()
        return kda.KdaPreBuild(tokens=s, qlen=L, nblocks=self.prev_valid_blocks, delta=delta, state_len=state_len,
                               eps=self.self_attention_res_norm.variance_epsilon,
                               out_eps=self.input_layernorm.variance_epsilon, onorm_eps=self.self_attn.o_norm.eps,
                               lower_bound=self.self_attn.gate_lower_bound,
                               write_idx=self.block_write_idx if self.is_block_write_layer else -1)

    def caches(self):
        """(conv_state as the dim-first [slots, dim, state_len] view, rstate)."""
        conv_state, rstate = self.self_attn.kv_cache
        if not dim_first():
            conv_state = conv_state.transpose(-1, -2)
        return conv_state, rstate

    def k1(self, prefix, blocks, delta, md):
        """K1 (vLLM's `_mono_kda_pre`, an eager break of a breakable graph) -> the core rows."""
        kda, _, runner = _mods()
        a = self.self_attn
        s = prefix.size(0)
        conv_state, rstate = self.caches()
        core = prefix.new_empty(s, self.cfg.p)
        kda.kda_pre(self._k1_key(s, md.L, delta is not None, conv_state.size(-1)), prefix=prefix, delta=delta,
                    blocks=blocks, ares_nw=self.self_attention_res_norm.weight,
                    ares_qk=self.self_attention_res_proj.weight.view(self.cfg.hidden),
                    in_nw=self.input_layernorm.weight, w_in=a.in_proj_qkvgfab.weight, w_fb=a.f_b_proj.weight,
                    conv_w=a.conv1d.weight.view(self.cfg.qkv, self.cfg.conv), conv_state=conv_state, a_log=a.A_log,
                    dt_bias=a.dt_bias, on_w=a.o_norm.weight, rstate=rstate, st_idx=md.spec_state_indices_tensor,
                    num_acc=md.num_accepted_tokens, core_out=core, **runner.launch_args(), layer=self.layer_idx)
        return core

    def launch(self, prefix, blocks, delta, md, comm, graph: bool = False):
        """K1 then K2 (or the dense MLP). Returns (the prefix buffer after the layer, its MLP output).
        graph: this forward is being captured (K1 an eager break, the rest in the capture)."""
        Graph.set(False)
        core = self.k1(prefix, blocks, delta, md)
        Graph.set(graph)
        reset = self.is_block_write_layer
        # a block-write layer: K1 stored the prefix as the block; the MLP side starts a fresh one
        # (zeroed: K2 does not read it, but ref.k2_launch refuses a NaN input, which empty may hold)
        k2_prefix = torch.zeros_like(prefix) if reset else prefix
        if self.dense is not None:
            return k2_prefix, self._dense_mlp(core, k2_prefix, blocks, reset, comm)
        return k2_prefix, _k2(self, core, k2_prefix, blocks, reset)

    def _dense_mlp(self, core, prefix, blocks, reset, comm):
        """vLLM's unfused dense layer after the attention: o_proj + all-reduce, the prefix update, the
        MLP AttnRes and norm, then the dense MLP (the fixed random projection of DESIGN §3)."""
        w, num, cfg = self.dense, self.num, self.cfg
        d = reduce_bf(o_proj_partial(core, w["w_o"], num), self.rank, comm, num)
        prefix.copy_(d if reset else num.bf(num.f(prefix) + num.f(d)))
        mixed = attnres(sources(blocks, cfg.k2_nblocks(self.layer_idx), prefix), w["ares_nw"], w["ares_qk"],
                        cfg.norm_eps("mlp_eps"), num)
        x = rmsnorm(mixed, w["in_nw"], cfg.norm_eps("mlp_out_eps"), num)
        return num.bf(num.mm(x, w["w_dense"]))


class FfnLayer(_Layer):
    """An MLA decoder layer: vLLM's AttnRes op and MLA attention up to o_proj's input, then K2."""

    def __init__(self, cfg, idx: int, rank: int, world: int, seed: int, fmt: str):
        super().__init__(cfg, idx, rank, seed)
        w1 = rsynth.k1_weights(cfg, idx, rank, seed)
        self.attn_res = dict(ares_nw=w1["ares_nw"], ares_qk=w1["ares_qk"], in_nw=w1["in_nw"])
        self.mla_proj = rsynth.mla_proj(cfg, idx, rank, seed)
        self._bind_moe(cfg, idx, rank, seed, fmt, world)

    def launch(self, prefix, blocks, delta, md, comm, graph: bool = False):
        cfg, num, w = self.cfg, self.num, self.attn_res
        if delta is not None:
            prefix.copy_(num.bf(num.f(prefix) + num.f(delta)))
        if self.is_block_write_layer:
            blocks[:, self.block_write_idx] = prefix
        mixed = attnres(sources(blocks, cfg.k1_nblocks(self.layer_idx), prefix), w["ares_nw"], w["ares_qk"],
                        cfg.eps, num)
        x = rmsnorm(mixed, w["in_nw"], cfg.norm_eps("out_eps"), num)
        core = num.bf(num.mm(x, self.mla_proj))
        reset = self.is_block_write_layer
        k2_prefix = torch.zeros_like(prefix) if reset else prefix
        return k2_prefix, _k2(self, core, k2_prefix, blocks, reset)


def build_model(cfg, layers, rank: int, world: int, seed: int, fmt: str, slots: int, state_len: int, S: int, L: int):
    """One rank's layers, its runner state, and every build compiled ahead."""
    _, _, runner = _mods()
    runner.alloc_scratch("cpu")
    runner.peers("cpu")
    model = [FfnLayer(cfg, i, rank, world, seed, fmt) if cfg.is_mla(i)
             else WholeLayer(cfg, i, rank, world, seed, fmt, slots, state_len) for i in layers]
    for layer in model:
        for mod, key in layer.builds(S, L):
            compile_build(mod, key)
    return model


class Graph:
    """vLLM's breakable CUDA graph, as the Python side sees it (vllm/compilation/breakable_cudagraph.py):
    while a forward is captured the stream is capturing, except in the eager breaks (`_mono_kda_pre`
    is one: K1 runs eagerly, outside the capture); a replay runs the captured segments without
    Python and calls only the eager breaks' functions again. `capturing` is what
    torch.cuda.is_current_stream_capturing would say on this thread."""

    _local = __import__("threading").local()

    @classmethod
    def capturing(cls) -> bool:
        return getattr(cls._local, "on", False)

    @classmethod
    def set(cls, on: bool) -> None:
        cls._local.on = on


def serve(cfg, layers, steps: int, rank: int, world: int, group, *, seed: int = 0, fmt: str = "mxfp4",
          requests: int = 3, padding: int = 1, num_spec: int = 1, num_acc=None, graph_steps=()) -> list:
    """Decode `steps` spec-verify steps of the stack `layers` as TP rank `rank`; returns each step's
    last MLP output. `group`: a SimWorld (this rank is a thread) or a torch.distributed group.
    graph_steps: forwards captured as a breakable CUDA graph and replayed once (see `Graph`)."""
    from vllm.distributed import set_worker

    from harness.synth import slot_plan
    from ref.comm import DistComm

    set_worker(rank, world, group)
    comm = group if hasattr(group, "all_reduce") else DistComm(group)
    _, _, runner = _mods()
    L = num_spec + 1
    S = requests * L
    st_idx, slots = slot_plan(requests, L, padding, rsynth.gen("cpu", seed, "standin-slots"))
    model = build_model(cfg, layers, rank, world, seed, fmt, slots, cfg.conv - 2 + L, S, L)
    outs = []
    for t in range(steps):
        graph = t in graph_steps
        Graph.set(graph)
        runner.step_begin()
        g = rsynth.gen("cpu", seed, "standin-step", t)
        na = (torch.tensor(num_acc[t], dtype=torch.int32) if num_acc is not None
              else torch.randint(1, L + 1, (requests,), generator=g, dtype=torch.int32))
        prefix, blocks, delta = rsynth.carry(cfg, S, layers[0], g, with_delta=layers[0] > 0)
        if layers[0] == 0:
            prefix = blocks[:, 0].clone()  # layer 0: the prefix is the embedding itself
        md = NS(spec_state_indices_tensor=st_idx, num_accepted_tokens=na, L=L)
        for layer in model:
            prefix, delta = layer.launch(prefix, blocks, delta, md, comm, graph)
        Graph.set(False)
        if graph:  # the replay: the captured segments (step_begin's epoch bump among them) run without
            # Python; only the eager breaks (K1) are Python calls again
            runner.launch_args()["epoch"].add_(1)
            for layer in model:
                if isinstance(layer, WholeLayer):
                    layer.k1(prefix.clone(), blocks.clone(), None if layer.layer_idx == layers[0] else delta, md)
        outs.append(delta)
    return outs


def serve_world(cfg, layers, steps: int, **kw) -> list:
    """Every rank of cfg.world in its own thread over one SimWorld (a rank = a vLLM worker)."""
    from ref.comm import SimWorld, run_world

    world = cfg.world
    comm = SimWorld(world)

    def worker(r):
        _, _, runner = _mods()
        try:
            return serve(cfg, layers, steps, r, world, comm, **kw)
        finally:
            runner.reset()

    return run_world(world, worker, comm)


__all__ = ["WholeLayer", "FfnLayer", "Graph", "_k2", "compile_build", "build_model", "serve", "serve_world"]
