"""Synthetic weights and step inputs with realistic statistics (DESIGN §8).

Sharded weights are drawn per *unit* (one head, 32 intermediate rows, 16 up rows),
each from its own seeded generator, so a rank draws only its own share and any
world size slices the same global model: world 1, 2, 4, 8 see identical weights.
"""
from __future__ import annotations

import hashlib

import torch

from .config import Config
from .quant import quantize_experts

BF16, F32 = torch.bfloat16, torch.float32
UNIT_RI = 32  # routed/shared intermediate rows per unit (one quant block)
UNIT_UP = 16  # w_up rows per unit
QUIET = 1e-3  # rms of the quiet token's carry (ref.synth.carry)


def seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def gen(device, *parts) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed_of(*parts))
    return g


def _randn(shape, g, device, std=1.0, mean=0.0):
    return torch.randn(shape, generator=g, device=device, dtype=F32) * std + mean


def _units(cfg: Config, rank: int, per_rank: int, unit: int) -> range:
    n = per_rank // unit
    return range(rank * n, (rank + 1) * n)


def k1_weights(cfg: Config, layer: int, rank: int, seed: int = 0, device="cpu") -> dict:
    """Per-rank K1 weights of a KDA layer (names of the K1 ABI)."""
    H, HD, NH, RK, W = cfg.hidden, cfg.hd, cfg.nh, cfg.rank, cfg.conv
    heads = range(rank * NH, (rank + 1) * NH)
    tag = (seed, layer, "k1")

    def per_head(name, shape, std, mean=0.0):
        return torch.cat([_randn(shape, gen(device, *tag, name, h), device, std, mean) for h in heads])

    q, k, v, g2 = (per_head(n, (HD, H), H ** -0.5) for n in ("wq", "wk", "wv", "wg2"))
    fa = _randn((RK, H), gen(device, *tag, "wfa"), device, H ** -0.5)
    b = per_head("wb", (1, H), H ** -0.5)
    pad = torch.zeros(cfg.nproj - cfg.nproj_raw, H, device=device)
    w_in = torch.cat([q, k, v, g2, fa, b, pad]).to(BF16)
    conv_w = torch.cat([per_head(f"conv_{n}", (HD, W), 0.4) for n in "qkv"]).to(BF16)
    # Trained-looking decay: A = exp(A_log) in [1, 16], A·dt_bias in [-8, -3].
    a = torch.cat([1.0 + 15.0 * torch.rand(1, generator=gen(device, *tag, "alog", h), device=device)
                   for h in heads])
    dt_bias = torch.cat([(-3.0 - 5.0 * torch.rand(HD, generator=gen(device, *tag, "dtb", h), device=device))
                         / a[i] for i, h in enumerate(heads)])
    rep = lambda name, shape, std, mean=0.0: _randn(shape, gen(device, *tag, name), device, std, mean)  # noqa: E731
    return dict(
        ares_nw=rep("ares_nw", (H,), 0.05, 1.0).to(BF16),
        ares_qk=rep("ares_qk", (H,), 1.5 * H ** -0.5).to(BF16),
        in_nw=rep("in_nw", (H,), 0.05, 1.0).to(BF16),
        w_in=w_in,
        w_fb=per_head("wfb", (HD, RK), 0.3 * RK ** -0.5).to(BF16),
        conv_w=conv_w,
        a_log=a.log(),
        dt_bias=dt_bias,
        on_w=rep("on_w", (HD,), 0.05, 1.0).to(BF16),
    )


def mla_proj(cfg: Config, layer: int, rank: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """[P, H] fixed random projection standing in for MLA attention (normed input -> core)."""
    heads = range(rank * cfg.nh, (rank + 1) * cfg.nh)
    return torch.cat([_randn((cfg.hd, cfg.hidden), gen(device, seed, layer, "mla", h), device,
                             cfg.hidden ** -0.5) for h in heads]).to(BF16)


def dense_weights(cfg: Config, layer: int, rank: int, seed: int = 0, device="cpu") -> dict:
    """Weights of the dense layer's stand-in (DESIGN §3): this rank's o_proj columns, the MLP
    AttnRes and post-attention norm, and a fixed random [H, H] projection for the dense MLP."""
    H, HD = cfg.hidden, cfg.hd
    tag = (seed, layer, "dense")
    rep = lambda name, shape, std, mean=0.0: _randn(shape, gen(device, *tag, name), device, std, mean)  # noqa: E731
    heads = range(rank * cfg.nh, (rank + 1) * cfg.nh)
    w_o = torch.cat([_randn((H, HD), gen(device, *tag, "wo", h), device, (cfg.nh * cfg.world * HD) ** -0.5)
                     for h in heads], dim=1)
    return dict(w_o=w_o.to(BF16), ares_nw=rep("ares_nw", (H,), 0.05, 1.0).to(BF16),
                ares_qk=rep("ares_qk", (H,), 1.5 * H ** -0.5).to(BF16), in_nw=rep("in_nw", (H,), 0.05, 1.0).to(BF16),
                w_dense=rep("w_dense", (H, H), H ** -0.5).to(BF16))


def k2_weights(cfg: Config, layer: int, rank: int, fmt: str, seed: int = 0, device="cpu") -> dict:
    """Per-rank K2 weights (names of the K2 ABI), experts quantized to `fmt`."""
    H, E, LAT, HD = cfg.hidden, cfg.experts, cfg.lat, cfg.hd
    tag = (seed, layer, "k2")
    g_ri, g_si = cfg.ri * cfg.world, cfg.si * cfg.world
    rep = lambda name, shape, std, mean=0.0: _randn(shape, gen(device, *tag, name), device, std, mean)  # noqa: E731
    heads = range(rank * cfg.nh, (rank + 1) * cfg.nh)
    w_o = torch.cat([_randn((H, HD), gen(device, *tag, "wo", h), device, (cfg.nh * cfg.world * HD) ** -0.5)
                     for h in heads], dim=1)
    si_units = _units(cfg, rank, cfg.si, UNIT_RI)
    sg = torch.cat([_randn((UNIT_RI, H), gen(device, *tag, "sg", u), device, H ** -0.5) for u in si_units])
    su = torch.cat([_randn((UNIT_RI, H), gen(device, *tag, "su", u), device, H ** -0.5) for u in si_units])
    sd = torch.cat([_randn((H, UNIT_RI), gen(device, *tag, "sd", u), device, g_si ** -0.5) for u in si_units], 1)
    ri_units = _units(cfg, rank, cfg.ri, UNIT_RI)

    def experts(name, shape, std, cat_dim):
        """Draw and quantize one unit at a time (a k3-tp8 rank holds ~10 GB of fp32 experts)."""
        ws, ss = [], []
        for u in ri_units:
            w, s = quantize_experts(_randn(shape, gen(device, *tag, name, u), device, std), fmt)
            ws.append(w)
            ss.append(s)
        return torch.cat(ws, dim=cat_dim), (None if ss[0] is None else torch.cat(ss, dim=cat_dim))

    g13, g13s = experts("eg", (E, UNIT_RI, LAT), LAT ** -0.5, 1)
    u13, u13s = experts("eu", (E, UNIT_RI, LAT), LAT ** -0.5, 1)
    w13 = torch.cat([g13, u13], dim=1)
    w13s = None if g13s is None else torch.cat([g13s, u13s], dim=1)
    w2, w2s = experts("ed", (E, LAT, UNIT_RI), g_ri ** -0.5, 2)
    up_units = _units(cfg, rank, cfg.up_n, UNIT_UP)
    w_up = torch.cat([_randn((UNIT_UP, LAT), gen(device, *tag, "up", u), device, LAT ** -0.5) for u in up_units])
    return dict(
        w_o=w_o.to(BF16),
        ares_nw=rep("ares_nw", (H,), 0.05, 1.0).to(BF16),
        ares_qk=rep("ares_qk", (H,), 1.5 * H ** -0.5).to(BF16),
        in_nw=rep("in_nw", (H,), 0.05, 1.0).to(BF16),
        w_gate=rep("w_gate", (E, H), H ** -0.5).to(BF16),
        bias=rep("bias", (E,), 0.02),
        w_ld=rep("w_ld", (LAT, H), H ** -0.5).to(BF16),
        w_sgu=torch.cat([sg, su]).to(BF16),
        w_sd=sd.to(BF16),
        w13=w13, w13s=w13s, w2=w2, w2s=w2s,
        ln_w=rep("ln_w", (LAT,), 0.05, 1.0).to(BF16),
        w_up=w_up.to(BF16),
    )


def hidden_like(shape, g: torch.Generator, device="cpu", std=1.0, massive=(3, 60.0)) -> torch.Tensor:
    """bf16 hidden-state rows with a few massive-activation channels."""
    h = torch.randn(shape, generator=g, device=device) * std
    n, mag = massive
    H = shape[-1]
    for i in range(n):
        ch = (i * 7919 + 17) % H
        h[..., ch] += mag * (1 + 0.1 * i)
    return h.to(BF16)


def carry(cfg: Config, S: int, layer: int, g: torch.Generator, device="cpu", with_delta=True):
    """A plausible AttnRes carry before `layer`: prefix, bank, pending delta."""
    H, NB = cfg.hidden, cfg.nbmax
    blocks = torch.zeros(S, NB, H, dtype=BF16, device=device)
    blocks[:, 0] = hidden_like((S, H), g, device)
    for b in range(1, NB):
        blocks[:, b] = hidden_like((S, H), g, device, std=1.0 + 0.5 * b, massive=(2, 20.0))
    prefix = hidden_like((S, H), g, device, std=1.5, massive=(2, 10.0))
    delta = hidden_like((S, H), g, device, std=0.5, massive=(0, 0.0)) if with_delta else None
    # token 0 is quiet (rms 1e-3, no massive channels): mean(v²) ~ 1e-6 sits below every
    # norm's eps, so a kernel that reads the wrong eps field changes its outputs
    blocks[0] = (torch.randn(NB, H, generator=g) * QUIET).to(BF16).to(device)
    prefix[0] = (torch.randn(H, generator=g) * QUIET).to(BF16).to(device)
    if delta is not None:
        delta[0] = (torch.randn(H, generator=g) * QUIET).to(BF16).to(device)
    return prefix, blocks, delta


def spec_indices(R: int, L: int, g: torch.Generator, pad_every: int = 0, device="cpu"):
    """Slot map of one speculative step over compacted caches.

    Request r owns slots 1 + r·L .. r·L + L (slot 0 is the null slot); its conv slot
    is st_idx[r, 0], as in vLLM where both caches share one slot-id space. Every
    `pad_every`-th request (if > 0) is padding: null slots (alternating 0 and -1).
    Returns st_idx [R, L] int32, num_acc [R] int32, and the slot count of each cache.
    """
    st = torch.zeros(R, L, dtype=torch.int32)
    for r in range(R):
        if pad_every and r % pad_every == pad_every - 1:
            st[r] = 0 if (r // pad_every) % 2 == 0 else -1
        else:
            st[r] = 1 + r * L + torch.arange(L, dtype=torch.int32)
    num_acc = torch.randint(1, L + 1, (R,), generator=g, dtype=torch.int32)
    return st.to(device), num_acc.to(device), 1 + R * L


def caches(cfg: Config, slots: int, state_len: int, g: torch.Generator, device="cpu"):
    """Random conv_state [CS, QKV, SL] bf16 and rstate [RS, NH, HD, HD] fp32."""
    conv_state = (torch.randn(slots, cfg.qkv, state_len, generator=g) * 0.8).to(BF16).to(device)
    rstate = (torch.randn(slots, cfg.nh, cfg.hd, cfg.hd, generator=g) * 0.05).to(device)
    return conv_state, rstate


def step_inputs(cfg: Config, layer: int, R: int, L: int, fmt: str, seed: int = 0, device="cpu",
                pad_every: int = 3, with_delta: bool = True, state_len: int | None = None):
    """One decode step of one KDA layer on every rank, ready to launch.

    Returns (k1_key, k1_args per rank, k2_key, k2_args per rank); each rank's K2 args
    share that rank's prefix/blocks with its K1 args, and K2's `core` is K1's `core_out`,
    so running K1 then K2 per rank chains them as the model does.
    """
    from .config import k1_build, k2_build

    S = R * L
    sl = state_len or cfg.conv - 2 + L
    g = gen("cpu", seed, layer, "step")
    prefix, blocks, delta = carry(cfg, S, layer, g, with_delta=with_delta)
    st_idx, num_acc, slots = spec_indices(R, L, g, pad_every)
    k1_key = k1_build(cfg, layer, S, L, delta is not None, sl)
    k2_key = k2_build(cfg, layer, S, fmt)
    k1s, k2s = [], []
    for r in range(cfg.world):
        conv_state, rstate = caches(cfg, slots, sl, gen("cpu", seed, layer, "cache", r))
        pf, bl = prefix.clone().to(device), blocks.clone().to(device)
        core = torch.full((S, cfg.p), float("nan"), dtype=BF16, device=device)
        k1 = dict(prefix=pf, delta=None if delta is None else delta.to(device), blocks=bl,
                  conv_state=conv_state.to(device), rstate=rstate.to(device), st_idx=st_idx.to(device),
                  num_acc=num_acc.to(device), core_out=core, layer=layer,
                  **k1_weights(cfg, layer, r, seed, device))
        w2 = k2_weights(cfg, layer, r, fmt, seed, device)
        k2 = dict(core=core, prefix=pf, blocks=bl, out=torch.full((S, cfg.hidden), float("nan"), dtype=BF16,
                                                                 device=device), layer=layer, **w2)
        k1s.append(k1)
        k2s.append(k2)
    return k1_key, k1s, k2_key, k2s
