"""K2 — o_proj all-reduce, MLP AttnRes, latent MoE, top to bottom (DESIGN §5 K2)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import abi
from ._num import Num
from .attnres import attnres, sources
from .comm import SimWorld, run_world
from .config import K2Build
from .kda_pre import Feed
from .latent_tail import latent_norm, up_proj
from .norms import rmsnorm
from .o_proj import o_proj_partial, reduce_bf
from .router import router_logits, select
from .routed_experts import routed_experts
from .shared_expert import shared_expert


def _check(key: K2Build, a: dict, mode: str, rank, comm) -> dict:
    if comm is None:
        raise abi.ArgError("comm", "K2 needs a collective (ref.comm.SimWorld / DistComm)")
    return abi.check_k2(key, a, mode, rank=rank, world=comm.world)


# Each stage's inputs (taps), for the isolated view; ln and out read every rank's y / fin.
K2_STAGE_INPUTS = {"delta": (), "prefix": ("delta",), "x": ("delta",), "logits": ("x",), "topk_ids": ("logits",),
                   "topk_w": ("logits",), "lat": ("x",), "sh": ("x",), "y": ("lat", "topk_ids", "topk_w"),
                   "ln": ("y",), "fin": ("sh", "ln"), "out": ("fin",)}


def k2_launch(key: K2Build, *, core, w_o, prefix, blocks, ares_nw, ares_qk, in_nw, w_gate, bias, w_ld, w_sgu,
              w_sd, w13, w13s, w2, w2s, ln_w, w_up, out, layer=None, rank=0, comm=None, taps=None, feed=None,
              mode: str = "exact", perturb: int | None = None, force_ids=None, **_runtime) -> None:
    """K2 of one rank. Writes prefix and out in place; meets the other ranks at 3 reductions.

    feed: {tap: tensor} of this rank of another implementation (the isolated view, every rank
    fed alike): each stage reads its inputs from there where given (K2_STAGE_INPUTS)."""
    args = dict(core=core, w_o=w_o, prefix=prefix, blocks=blocks, ares_nw=ares_nw, ares_qk=ares_qk, in_nw=in_nw,
                w_gate=w_gate, bias=bias, w_ld=w_ld, w_sgu=w_sgu, w_sd=w_sd, w13=w13, w13s=w13s, w2=w2,
                w2s=w2s, ln_w=ln_w, w_up=w_up, out=out)
    _check(key, args, mode, rank, comm)
    num = Num(mode, perturb)
    fed = Feed(feed)
    beta, lam = key.situ_beta, key.situ_linear_beta

    # 1. o_proj partial, all-reduce #1
    delta = reduce_bf(o_proj_partial(core, w_o, num), rank, comm, num)
    # 2. prefix update (bf16 add unless this layer starts a block)
    d_in = fed.use("delta", delta)
    prefix.copy_(d_in if key.reset else num.bf(num.f(prefix) + num.f(d_in)))
    # 3. MLP AttnRes + post-attention norm
    mixed = attnres(sources(blocks, key.nblocks, prefix), ares_nw, ares_qk, key.eps, num)
    x = rmsnorm(mixed, in_nw, key.out_eps, num)
    x_in = fed.use("x", x)
    # 4. router (replicated)
    logits = router_logits(x_in, w_gate, num)
    ids, weights = select(fed.use("logits", logits), bias, key.topk, force_ids)
    # 5-7. latent down, shared experts, routed experts
    lat = num.bf(num.mm(x_in, w_ld))
    sh = shared_expert(x_in, w_sgu, w_sd, beta, lam, num)
    y = routed_experts(fed.use("lat", lat), fed.use("topk_ids", ids), fed.use("topk_w", weights), w13, w13s, w2,
                       w2s, key.experts, beta, lam, num)
    # 8. latent all-reduce #2 + norm
    ln = latent_norm(reduce_bf(fed.use("y", y), rank, comm, num), ln_w, key.ln_eps, num)
    # 9-10. row-sharded up projection, final all-reduce #3
    fin = up_proj(fed.use("sh", sh), fed.use("ln", ln), w_up, rank, num)
    out.copy_(reduce_bf(fed.use("fin", fin), rank, comm, num))
    if taps is not None:
        taps.update(delta=delta, x=x, logits=logits, topk_ids=ids, topk_w=weights, lat=lat, sh=sh, y=y,
                    ln=ln, fin=fin)


def k2_world(key: K2Build, ranks: Sequence[dict], launch: Callable | None = None, comm=None,
             order: Sequence[int] | None = None, **extra) -> None:
    """Run every rank of one K2 step in this process (a thread per rank, simulated collective).

    ranks: one kwarg dict per rank (the K2 names without rank/comm; may hold taps={}).
    launch: a backend's k2_launch (default: the reference). extra: passed to every rank
    (mode=, perturb=, ...). The reductions keep rank order (the contract) unless `order` says
    otherwise.
    """
    launch = launch or k2_launch
    world = len(ranks)
    if comm is None:
        comm = SimWorld(world, order)
    run_world(world, lambda r: launch(key, **ranks[r], **extra, rank=r, comm=comm), comm)


def upcast(kwargs: dict) -> dict:
    """Copy for oracle mode: every floating tensor to float64 (exact), others cloned."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.double() if v.is_floating_point() else v.clone()
        elif isinstance(v, dict) and k != "taps":
            out[k] = upcast(v)
        else:
            out[k] = v
    return out
