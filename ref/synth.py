"""Synthetic weights and step inputs with realistic statistics (DESIGN §8).

Weights are drawn by *global coordinate* with a counter-based hash: element i of global
tensor T of (seed, layer, launch) takes the 16-bit draw `half(h(i >> 1), i & 1)` of a
32-bit avalanche hash keyed by sha256(seed, layer, launch, T), mapped through a fixed
65536-entry table to its distribution. Any unit (a head, 32 intermediate rows, 16 up rows)
is drawn independently of the others, so a rank draws only its own share and world 1, 2,
4, 8 slice the same global model. The device does integer arithmetic and table lookups
only (no device RNG, no transcendental or rounding op), so the bits are the same on CPU,
CUDA and ROCm; the tables are built on the host in float64 (Python / CPU torch) and
rounded once to the target dtype on the CPU. `VERSION` names the generator's output:
bump it on any change to a drawn value.

Discriminating on purpose (issue H): expert pairs share their router row and bias
(`router_twins`), so router keys tie exactly, inside the top-k and at its boundary.

Step inputs (carry, caches, slot ids) come from a seeded CPU torch.Generator (`gen`):
captures store them, they are never regenerated.
"""
from __future__ import annotations

import functools
import hashlib
import math
import statistics

import torch

from .config import Config
from .quant import E2M1_MAG, QBLOCK, e2m1_encode

GENERATOR = "ref.synth"
VERSION = 2  # 1: the torch.randn generator before the integer recipe
BF16, F32, F64, I64, U8 = torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.uint8
UNIT_RI = 32  # routed/shared intermediate rows per unit (one quant block)
UNIT_UP = 16  # w_up rows per unit
QUIET = 1e-3  # rms of the quiet token's carry (ref.synth.carry)
WHICH = ("k1", "k2", "dense", "mla")  # the weight sets a recipe can name

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2^27: a product with a 32-bit value stays below 2^59
_CHUNK = {"cpu": 1 << 17}  # hashes per pass, by device type: cache-sized on a CPU,
_CHUNK_DEV = 1 << 24  # launch-amortizing on a GPU (128 MiB int64 temporaries); bits never depend on it
_T = 1 << 16  # table size: one 16-bit draw per element


def seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def gen(device, *parts) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed_of(*parts))
    return g


# --------------------------------------------------------------------------- the counter-based draw

def _salts(*parts) -> tuple[int, int]:
    d = hashlib.sha256(repr(("ref.synth", VERSION) + parts).encode()).digest()
    return int.from_bytes(d[:4], "little"), int.from_bytes(d[4:8], "little")


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """In place: a 32-bit avalanche (two multiply rounds) of int64 values in [0, 2^32)."""
    x.bitwise_xor_(x >> 16).mul_(_MUL).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 16).mul_(_MUL).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def _hash_(ids: torch.Tensor, salts: tuple[int, int]) -> torch.Tensor:
    """32-bit hash of non-negative int64 ids (in place on a fresh tensor)."""
    hi = ids >> 32
    x = _mix_(ids.bitwise_and_(_M32).bitwise_xor_(salts[0]))
    return _mix_(x.bitwise_xor_(hi).bitwise_xor_(salts[1]))


def _u16(salts, flat: torch.Tensor) -> torch.Tensor:
    """16-bit draws of global flat indices (any): half (flat & 1) of h(flat >> 1)."""
    h = _hash_(flat >> 1, salts)
    return (h >> ((flat & 1) * 16)).bitwise_and_(0xFFFF)


def _draw(salts, gshape, index: list, table: torch.Tensor, device) -> torch.Tensor:
    """table[u16] for the slice of a global row-major tensor of shape `gshape`.

    index: one int64 tensor of global indices per leading dim, then (start, n) for a
    contiguous range of the last dim. Returns [len(i0), ..., n] of table's dtype."""
    table = table.to(device)
    glast = gshape[-1]
    c0, n = index[-1]
    lead = index[:-1]
    strides = [math.prod(gshape[d + 1:-1]) for d in range(len(lead))]
    rows = torch.zeros((), dtype=I64, device=device)
    for d, (idx, st) in enumerate(zip(lead, strides)):
        rows = rows.unsqueeze(-1) + idx.to(device=device, dtype=I64).reshape((1,) * d + (-1,)) * st
    rows = rows.reshape(-1)
    out = torch.empty(rows.numel(), n, dtype=table.dtype, device=device)
    paired = glast % 2 == 0 and c0 % 2 == 0 and n % 2 == 0
    per = max(1, _CHUNK.get(torch.device(device).type, _CHUNK_DEV) // max(1, n // 2 if paired else n))
    for lo in range(0, rows.numel(), per):
        rb = rows[lo:lo + per, None] * glast
        if paired:  # one hash gives the two draws of an element pair (the same as _u16)
            h = _hash_((rb + c0) // 2 + torch.arange(n // 2, dtype=I64, device=device), salts)
            u = torch.stack([h & 0xFFFF, h >> 16], dim=-1).reshape(-1, n)
        else:
            u = _u16(salts, rb + torch.arange(c0, c0 + n, dtype=I64, device=device))
        out[lo:lo + per] = table[u]
    return out.reshape(*(len(i) for i in lead), n)


def _rng(a: int, b: int) -> torch.Tensor:
    return torch.arange(a, b, dtype=I64)


# --------------------------------------------------------------------------- host tables

@functools.lru_cache(maxsize=None)
def _normal_q() -> tuple[float, ...]:
    """N(0, 1) at the 65536 mid-quantiles (pure Python float arithmetic)."""
    nd = statistics.NormalDist()
    return tuple(nd.inv_cdf((i + 0.5) / _T) for i in range(_T))


@functools.lru_cache(maxsize=256)
def _normal(std: float, mean: float, dtype: torch.dtype) -> torch.Tensor:
    # float64 table, rounded once to the target dtype on the CPU (round to nearest even)
    return (torch.tensor(_normal_q(), dtype=F64) * std + mean).to(dtype)


@functools.lru_cache(maxsize=256)
def _uniform(lo: float, hi: float, dtype: torch.dtype) -> torch.Tensor:
    u = (torch.arange(_T, dtype=F64) + 0.5) / _T
    return (lo + (hi - lo) * u).to(dtype)


@functools.lru_cache(maxsize=4)
def _nibbles(fmt: str) -> torch.Tensor:
    """256 4-bit codes at the mid-quantiles of N(0, 1): int4 -> an unsigned nibble u (value
    u - 8) of N(0, 2.9) rounded and clamped to 0..15; mxfp4/a8w4 -> the E2M1 code of N(0, 2),
    a block-normalized weight saturating at ±6."""
    nd = statistics.NormalDist()
    q = torch.tensor([nd.inv_cdf((j + 0.5) / 256) for j in range(256)], dtype=F64)
    if fmt == "int4":
        return torch.clamp(torch.round(q * 2.9) + 8, 0, 15).to(I64)
    return e2m1_encode(q * 2.0).to(I64)


@functools.lru_cache(maxsize=4)
def _packed(fmt: str) -> torch.Tensor:
    """16-bit draw -> one packed byte of two codes (low nibble from the low 8 bits)."""
    lut = _nibbles(fmt)
    v = torch.arange(_T, dtype=I64)
    return (lut[v & 0xFF] | (lut[v >> 8] << 4)).to(U8)


def _code_rms(fmt: str) -> float:
    """rms of the code values of `_nibbles(fmt)` at scale 1."""
    lut = _nibbles(fmt)
    v = lut.to(F64) - 8 if fmt == "int4" else torch.tensor(E2M1_MAG + tuple(-m for m in E2M1_MAG), dtype=F64)[lut]
    return float(v.square().mean().sqrt())


@functools.lru_cache(maxsize=64)
def _e8m0(std: float) -> torch.Tensor:
    """E8M0 scale codes: the two powers of two 2^b, 2^(b+1) around std / rms(codes), mixed in
    the proportion that gives the weights exactly std (block scales vary, as a trained
    tensor's do)."""
    s = std / _code_rms("mxfp4")
    b = math.floor(math.log2(s))
    t = ((s / 2.0 ** b) ** 2 - 1) / 3  # (1-t)·4^b + t·4^(b+1) = s²
    code = min(max(127 + b, 1), 253)
    v = torch.arange(_T, dtype=I64)
    return (code + (v >= round((1 - t) * _T)).to(I64)).to(U8)


@functools.lru_cache(maxsize=64)
def _int4_scale(std: float) -> torch.Tensor:
    """bf16 int4 scales near std / rms(u - 8), five significant bits (every (u-8)·scale is
    then exact in bf16), jittered by 7/8 .. 9/8."""
    def five_bits(x):
        m, e = math.frexp(x)
        return math.ldexp(round(m * 32) / 32, e)

    base = std / _code_rms("int4")
    vals = [five_bits(base * f) for f in (0.875, 1.0, 1.0, 1.125)]
    v = torch.arange(_T) * len(vals) // _T
    return torch.tensor(vals, dtype=F64)[v].to(BF16)


# --------------------------------------------------------------------------- weights

class _Drawer:
    """Draws the tensors of one (seed, layer, launch) on `device`."""

    def __init__(self, seed: int, layer: int, which: str, device):
        self.tag, self.device = (seed, layer, which), torch.device(device)

    def __call__(self, name, gshape, index, table):
        return _draw(_salts(*self.tag, name), gshape, index, table, self.device)

    def normal(self, name, gshape, index, std, mean=0.0, dtype=BF16):
        return self(name, gshape, index, _normal(float(std), float(mean), dtype))

    def vector(self, name, n, std, mean=0.0, dtype=BF16):
        """A replicated [n] vector."""
        return self.normal(name, (n,), [(0, n)], std, mean, dtype)

    def rows(self, name, g_rows, lo, hi, cols, std, dtype=BF16):
        """Rows [lo, hi) of a global [g_rows, cols] matrix."""
        return self.normal(name, (g_rows, cols), [_rng(lo, hi), (0, cols)], std, 0.0, dtype)

    def cols(self, name, rows, g_cols, lo, hi, std, dtype=BF16):
        """Columns [lo, hi) of a global [rows, g_cols] matrix."""
        return self.normal(name, (rows, g_cols), [_rng(0, rows), (lo, hi - lo)], std, 0.0, dtype)


def _heads(cfg: Config, rank: int) -> tuple[int, int]:
    return rank * cfg.nh, (rank + 1) * cfg.nh


def k1_weights(cfg: Config, layer: int, rank: int, seed: int = 0, device="cpu") -> dict:
    """Per-rank K1 weights of a KDA layer (names and dtypes of the K1 ABI, as vLLM passes them:
    conv_w, a_log, dt_bias fp32)."""
    H, HD, NH, RK, W = cfg.hidden, cfg.hd, cfg.nh, cfg.rank, cfg.conv
    ng = NH * cfg.world  # global heads
    h0, h1 = _heads(cfg, rank)
    dr = _Drawer(seed, layer, "k1", device)
    std = H ** -0.5
    q, k, v, g2 = (dr.rows(n, ng * HD, h0 * HD, h1 * HD, H, std) for n in ("wq", "wk", "wv", "wg2"))
    fa = dr.rows("wfa", RK, 0, RK, H, std)
    b = dr.rows("wb", ng, h0, h1, H, std)
    pad = torch.zeros(cfg.nproj - cfg.nproj_raw, H, dtype=BF16, device=dr.device)
    conv_w = torch.cat([dr.normal(f"conv_{n}", (ng * HD, W), [_rng(h0 * HD, h1 * HD), (0, W)], 0.4, dtype=F32)
                        for n in "qkv"])
    # Trained-looking decay, drawn directly: A = exp(A_log) in [1, 16], A·dt_bias in [-8, -3].
    a_log = dr("alog", (ng,), [(0, ng)], _uniform(0.0, math.log(16.0), F32))[h0:h1]
    inv_a = [math.exp(-float(x)) for x in a_log.cpu().tolist()]  # on the host: 1/A of each head
    dt = dr("dtb", (ng * HD,), [(h0 * HD, NH * HD)], torch.arange(_T, dtype=I64))  # the 16-bit draws themselves
    tables = torch.stack([_uniform(-8.0 * s, -3.0 * s, F32) for s in inv_a]).to(dr.device)  # [NH, T]
    dt_bias = tables.gather(1, dt.reshape(NH, HD)).reshape(-1)
    return dict(
        ares_nw=dr.vector("ares_nw", H, 0.05, 1.0),
        ares_qk=dr.vector("ares_qk", H, 1.5 * H ** -0.5),
        in_nw=dr.vector("in_nw", H, 0.05, 1.0),
        w_in=torch.cat([q, k, v, g2, fa, b, pad]),
        w_fb=dr.rows("wfb", ng * HD, h0 * HD, h1 * HD, RK, 0.3 * RK ** -0.5),
        conv_w=conv_w,
        a_log=a_log,
        dt_bias=dt_bias,
        on_w=dr.vector("on_w", HD, 0.05, 1.0),
    )


def mla_proj(cfg: Config, layer: int, rank: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """[P, H] fixed random projection standing in for MLA attention (normed input -> core)."""
    h0, h1 = _heads(cfg, rank)
    dr = _Drawer(seed, layer, "mla", device)
    return dr.rows("w_mla", cfg.nh * cfg.world * cfg.hd, h0 * cfg.hd, h1 * cfg.hd, cfg.hidden, cfg.hidden ** -0.5)


def _w_o(dr: _Drawer, cfg: Config, rank: int) -> torch.Tensor:
    pg = cfg.nh * cfg.world * cfg.hd
    return dr.cols("wo", cfg.hidden, pg, rank * cfg.p, (rank + 1) * cfg.p, pg ** -0.5)


def dense_weights(cfg: Config, layer: int, rank: int, seed: int = 0, device="cpu") -> dict:
    """Weights of the dense layer's stand-in (DESIGN §3): this rank's o_proj columns, the MLP
    AttnRes and post-attention norm, and a fixed random [H, H] projection for the dense MLP."""
    H = cfg.hidden
    dr = _Drawer(seed, layer, "dense", device)
    return dict(w_o=_w_o(dr, cfg, rank), ares_nw=dr.vector("ares_nw", H, 0.05, 1.0),
                ares_qk=dr.vector("ares_qk", H, 1.5 * H ** -0.5), in_nw=dr.vector("in_nw", H, 0.05, 1.0),
                w_dense=dr.rows("w_dense", H, 0, H, H, H ** -0.5))


def router_twins(experts: int) -> list[int]:
    """src[e]: the expert whose router row and bias expert e copies (src[e] == e: its own).

    Pairs: (e, e+1) for e ≡ 0 mod 4 and (e, e+E/2) for e ≡ 2 mod 4, e < E/2 (E/2 a multiple
    of 4), so half the experts tie with a neighbour or a far id and a top-k boundary often
    falls between two equal keys."""
    src = list(range(experts))
    half = experts // 2
    for e in range(half):
        if e % 4 == 0 and e + 1 < half:
            src[e + 1] = e
        elif e % 4 == 2 and half % 4 == 0:
            src[e + half] = e
    return src


def _experts(dr: _Drawer, name: str, fmt: str, gshape, index, std):
    """(weights, scales) of one expert tensor slice in `fmt`'s logical layout (DESIGN §7);
    gshape/index over the logical [E, N, K] values, K sliced in whole quant blocks."""
    (c0, n) = index[-1]
    if fmt == "bf16":
        return dr.normal(name, gshape, index, std), None
    E, N, K = gshape
    packed = dr(name, (E, N, K // 2), index[:-1] + [(c0 // 2, n // 2)], _packed(fmt))
    si = index[:-1] + [(c0 // QBLOCK, n // QBLOCK)]
    table = _int4_scale(std) if fmt == "int4" else _e8m0(std)
    return packed, dr(name + ".scale", (E, N, K // QBLOCK), si, table)


def k2_weights(cfg: Config, layer: int, rank: int, fmt: str, seed: int = 0, device="cpu") -> dict:
    """Per-rank K2 weights (names and dtypes of the K2 ABI, router bias fp32), experts in `fmt`."""
    H, E, LAT = cfg.hidden, cfg.experts, cfg.lat
    g_ri, g_si = cfg.ri * cfg.world, cfg.si * cfg.world
    dr = _Drawer(seed, layer, "k2", device)
    src = torch.tensor(router_twins(E), dtype=I64)
    s0, s1 = rank * cfg.si, (rank + 1) * cfg.si
    r0, r1 = rank * cfg.ri, (rank + 1) * cfg.ri
    allE = _rng(0, E)
    g13, g13s = _experts(dr, "eg", fmt, (E, g_ri, LAT), [allE, _rng(r0, r1), (0, LAT)], LAT ** -0.5)
    u13, u13s = _experts(dr, "eu", fmt, (E, g_ri, LAT), [allE, _rng(r0, r1), (0, LAT)], LAT ** -0.5)
    w2, w2s = _experts(dr, "ed", fmt, (E, LAT, g_ri), [allE, _rng(0, LAT), (r0, cfg.ri)], g_ri ** -0.5)
    bias = dr.vector("bias", E, 0.02, dtype=F32)[src.to(dr.device)]
    return dict(
        w_o=_w_o(dr, cfg, rank),
        ares_nw=dr.vector("ares_nw", H, 0.05, 1.0),
        ares_qk=dr.vector("ares_qk", H, 1.5 * H ** -0.5),
        in_nw=dr.vector("in_nw", H, 0.05, 1.0),
        w_gate=dr.normal("w_gate", (E, H), [src, (0, H)], H ** -0.5),
        bias=bias,
        w_ld=dr.rows("w_ld", LAT, 0, LAT, H, H ** -0.5),
        w_sgu=torch.cat([dr.rows("sg", g_si, s0, s1, H, H ** -0.5), dr.rows("su", g_si, s0, s1, H, H ** -0.5)]),
        w_sd=dr.cols("sd", H, g_si, s0, s1, g_si ** -0.5),
        w13=torch.cat([g13, u13], dim=1), w13s=None if g13s is None else torch.cat([g13s, u13s], dim=1),
        w2=w2, w2s=w2s,
        ln_w=dr.vector("ln_w", LAT, 0.05, 1.0),
        w_up=dr.rows("up", H, rank * cfg.up_n, (rank + 1) * cfg.up_n, LAT, LAT ** -0.5),
    )


def weights(which: str, cfg: Config, layer: int, rank: int, fmt: str | None = None, seed: int = 0,
            device="cpu") -> dict:
    """One weight set by name (WHICH): k1 | k2 (experts in `fmt`) | dense | mla ({'w_mla': [P, H]})."""
    if which == "k1":
        return k1_weights(cfg, layer, rank, seed, device)
    if which == "k2":
        return k2_weights(cfg, layer, rank, fmt, seed, device)
    if which == "dense":
        return dense_weights(cfg, layer, rank, seed, device)
    if which == "mla":
        return {"w_mla": mla_proj(cfg, layer, rank, seed, device)}
    raise ValueError(f"which: {which!r} not in {WHICH}")


# --------------------------------------------------------------------------- step inputs (stored, not regenerated)

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
