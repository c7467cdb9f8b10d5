"""K1 — KDA pre-attention, top to bottom as the kernel runs it (DESIGN §5 K1)."""
from __future__ import annotations

import torch

from . import abi
from ._num import Num
from .attnres import attnres, sources
from .config import KdaPreBuild
from .conv import short_conv
from .gate import gates
from .in_proj import in_proj, split
from .kda import kda_recurrence
from .norms import gated_rmsnorm, rmsnorm


def _check(key: KdaPreBuild, a: dict, mode: str) -> dict:
    return abi.check_k1(key, a, mode)


# Each stage's inputs (taps), for the isolated view: a stage is isolated when all are fed.
K1_STAGE_INPUTS = {"x": (), "proj": ("x",), "conv_out": ("proj",), "gate": ("proj",), "beta": ("proj",),
                   "o": ("conv_out", "gate", "beta"), "core_out": ("o", "proj"), "conv_state": ("proj",),
                   "rstate": ("conv_out", "gate", "beta")}


class Feed:
    """The isolated view (DESIGN §9): stage inputs taken from another implementation's taps.

    `use(name, own)` returns the fed tap (as own's dtype and device) or, when none is fed,
    the composition's own value. `isolated(stage, inputs)` says whether every input of a
    stage was fed, i.e. whether its output measures only its own arithmetic."""

    def __init__(self, taps: dict | None):
        self.taps = taps or {}

    def use(self, name: str, own):
        t = self.taps.get(name)
        if t is None:
            return own
        if tuple(t.shape) != tuple(own.shape):
            raise abi.ArgError(f"feed.{name}", f"shape {tuple(t.shape)}, expected {tuple(own.shape)}")
        return t.to(device=own.device, dtype=own.dtype)

    def isolated(self, inputs) -> bool:
        return all(n in self.taps for n in inputs)


def kda_pre(key: KdaPreBuild, *, prefix, delta, blocks, ares_nw, ares_qk, in_nw, w_in, w_fb, conv_w,
            conv_state, a_log, dt_bias, on_w, rstate, st_idx, num_acc, core_out, layer=None, taps=None,
            feed=None, mode: str = "exact", perturb: int | None = None, **_runtime) -> None:
    """K1 of one rank. Writes prefix, blocks[:, write_idx], conv_state, rstate, core_out in place.

    feed: {tap: tensor} of another implementation (the isolated view): each stage reads its
    inputs from there where given (K1_STAGE_INPUTS), so every output measures one stage."""
    args = dict(prefix=prefix, delta=delta, blocks=blocks, ares_nw=ares_nw, ares_qk=ares_qk, in_nw=in_nw,
                w_in=w_in, w_fb=w_fb, conv_w=conv_w, conv_state=conv_state, a_log=a_log, dt_bias=dt_bias,
                on_w=on_w, rstate=rstate, st_idx=st_idx, num_acc=num_acc, core_out=core_out)
    d = _check(key, args, mode)
    num = Num(mode, perturb)
    fed = Feed(feed)
    NH, HD, RK = d["NH"], d["HD"], d["RK"]

    # 1. pending delta, block write (bf16 add: the one rounding of the carry)
    if delta is not None:
        prefix.copy_(num.bf(num.f(prefix) + num.f(delta)))
    pre = prefix
    if key.write_idx >= 0:
        blocks[:, key.write_idx] = pre
    # 2-3. AttnRes over bank + prefix, then the input norm
    mixed = attnres(sources(blocks, key.nblocks, pre), ares_nw, ares_qk, key.eps, num)
    x = rmsnorm(mixed, in_nw, key.out_eps, num)
    # 4. in_proj
    proj = in_proj(fed.use("x", x), w_in, num)
    parts = split(fed.use("proj", proj), NH, HD, RK)
    # 5. short conv with speculative state
    conv_out = short_conv(parts["qkv"], conv_w, conv_state, st_idx, num_acc, key.qlen, num)
    # 6. gates
    gate, beta = gates(parts["fa"], parts["b"], w_fb, a_log, dt_bias, key.lower_bound, num)
    # 7. recurrence
    P = NH * HD
    qkv = fed.use("conv_out", conv_out)
    q, k, v = (qkv[:, i * P:(i + 1) * P].reshape(-1, NH, HD) for i in range(3))
    o = kda_recurrence(q, k, v, fed.use("gate", gate), fed.use("beta", beta), rstate, st_idx, num_acc, key.qlen,
                       num)
    # 8. gated norm
    core_out.copy_(gated_rmsnorm(fed.use("o", o), parts["g2"].reshape(-1, NH, HD), on_w, key.onorm_eps, num))
    if taps is not None:
        taps.update(x=x, proj=proj, conv_out=conv_out, gate=gate, beta=beta, o=o)
