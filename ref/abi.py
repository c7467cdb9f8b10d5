"""The launch ABI of K1 and K2 as ordered lists of names (DESIGN §6), with the
shape and dtype of every tensor, and the strict validation every backend shares.

Shape symbols: S tokens, H hidden, NB bank rows, NP in_proj rows, P = NH·HD, RK f_a
rank, C = 3P conv channels, W conv width, SL state_len, CS/RS conv/recurrent slots,
NH heads, HD head dim, R requests, SW st_idx width, E experts, LAT latent, SI2 = 2·SI,
SI shared intermediate, RI2 = 2·RI, RI, LATq = LAT/2 (packed), LATs = LAT/32,
RIq = RI/2, RIs = RI/32, UP rows of w_up.
"""
from __future__ import annotations

import math

import torch

from .config import EXPERT_FORMATS, Config, K2Build, KdaPreBuild

BF16, F32, F64, I32, U8 = torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.uint8
QUANTIZED = ("mxfp4", "int4", "a8w4")  # expert formats with packed weights and scales

# name, shape, dtype class ("act" = bf16 in exact mode / f64 in oracle; "f32" = fp32 /
# f64; "w32" = fp32 or bf16 (read exactly: vLLM passes conv1d.weight fp32, the router bias
# fp32 or bf16) / f64; fixed dtypes otherwise), role: in | inout | out | opt (may be None)
K1_ARGS: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("prefix", ("S", "H"), "act", "inout"),
    ("delta", ("S", "H"), "act", "opt"),
    ("blocks", ("S", "NB", "H"), "act", "inout"),
    ("ares_nw", ("H",), "act", "in"),
    ("ares_qk", ("H",), "act", "in"),
    ("in_nw", ("H",), "act", "in"),
    ("w_in", ("NP", "H"), "act", "in"),
    ("w_fb", ("P", "RK"), "act", "in"),
    ("conv_w", ("C", "W"), "w32", "in"),
    ("conv_state", ("CS", "C", "SL"), "act", "inout"),
    ("a_log", ("NH",), "f32", "in"),
    ("dt_bias", ("P",), "f32", "in"),
    ("on_w", ("HD",), "act", "in"),
    ("rstate", ("RS", "NH", "HD", "HD"), "f32", "inout"),
    ("st_idx", ("R", "SW"), "i32", "in"),
    ("num_acc", ("R",), "i32", "in"),
    ("core_out", ("S", "P"), "act", "out"),
)
K1_NAMES = tuple(a[0] for a in K1_ARGS) + ("layer",)

K2_ARGS: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("core", ("S", "P"), "act", "in"),
    ("w_o", ("H", "P"), "act", "in"),
    ("prefix", ("S", "H"), "act", "inout"),
    ("blocks", ("S", "NB", "H"), "act", "in"),
    ("ares_nw", ("H",), "act", "in"),
    ("ares_qk", ("H",), "act", "in"),
    ("in_nw", ("H",), "act", "in"),
    ("w_gate", ("E", "H"), "act", "in"),
    ("bias", ("E",), "w32", "in"),
    ("w_ld", ("LAT", "H"), "act", "in"),
    ("w_sgu", ("SI2", "H"), "act", "in"),
    ("w_sd", ("H", "SI"), "act", "in"),
    ("w13", ("E", "RI2", "*"), "w", "in"),
    ("w13s", ("E", "RI2", "*"), "ws", "opt"),
    ("w2", ("E", "LAT", "*"), "w", "in"),
    ("w2s", ("E", "LAT", "*"), "ws", "opt"),
    ("ln_w", ("LAT",), "act", "in"),
    ("w_up", ("UP", "LAT"), "act", "in"),
    ("out", ("S", "H"), "act", "out"),
)
K2_NAMES = tuple(a[0] for a in K2_ARGS) + ("layer", "rank", "comm")

# Read-only weights (the rest is state, activations and outputs). In oracle mode they may
# come in their stored dtype: every use upcasts them exactly (Num.f, or a dequant to f64).
K1_WEIGHTS = ("ares_nw", "ares_qk", "in_nw", "w_in", "w_fb", "conv_w", "a_log", "dt_bias", "on_w")
K2_WEIGHTS = ("w_o", "ares_nw", "ares_qk", "in_nw", "w_gate", "bias", "w_ld", "w_sgu", "w_sd", "w13", "w13s", "w2",
              "w2s", "ln_w", "w_up")
_WEIGHTS = frozenset(K1_WEIGHTS + K2_WEIGHTS)

K1_TAPS = ("x", "proj", "conv_out", "gate", "beta", "o")
K2_TAPS = ("delta", "x", "logits", "topk_ids", "topk_w", "lat", "sh", "y", "ln", "fin")

# Named dims of each tap, for worst-element locations in reports.
TAP_DIMS = {
    "x": ("token", "channel"), "proj": ("token", "channel"), "conv_out": ("token", "channel"),
    "gate": ("token", "head", "channel"), "beta": ("token", "head"), "o": ("token", "head", "channel"),
    "delta": ("token", "channel"), "logits": ("token", "expert"), "topk_ids": ("token", "k"),
    "topk_w": ("token", "k"), "lat": ("token", "channel"), "sh": ("token", "channel"),
    "y": ("token", "channel"), "ln": ("token", "channel"), "fin": ("token", "channel"),
    "core_out": ("token", "channel"), "prefix": ("token", "channel"), "out": ("token", "channel"),
    "blocks": ("token", "block", "channel"), "conv_state": ("slot", "channel", "pos"),
    "rstate": ("slot", "head", "v", "k"),
}


class ArgError(ValueError):
    """A launch argument is malformed. `field` names it."""

    def __init__(self, field: str, msg: str):
        super().__init__(f"{field}: {msg}")
        self.field = field


def _dtype_ok(name: str, t: torch.Tensor, cls: str, mode: str, fmt: str | None) -> str | None:
    """None if t's dtype fits its class, else the expected dtype in words."""
    fl = F64 if mode == "oracle" else None
    if cls == "act":
        want = (BF16,)
    elif cls == "f32":
        want = (F32,)
    elif cls == "w32":
        want = (F32, BF16)
    elif cls == "i32":
        want = (I32,)
    elif cls == "w":
        want = (U8,) if fmt in QUANTIZED else (BF16,)
    elif cls == "ws":
        want = {"mxfp4": (U8,), "a8w4": (U8,), "int4": (BF16,)}.get(fmt, ())
    else:  # pragma: no cover
        raise AssertionError(cls)
    if fl is not None and want and want != (U8,) and cls != "i32":
        # oracle: state and activations f64; a weight in its stored dtype or f64
        want = (want + (fl,)) if name in _WEIGHTS else (fl,)
    if t.dtype in want:
        return None
    return " or ".join(str(w).replace("torch.", "") for w in want) or "None"


def check_args(spec, args: dict, mode: str = "exact", fmt: str | None = None, check_finite: bool = True,
               expect: dict[str, int] | None = None, expect_from: str = "the config") -> dict[str, int]:
    """Validate shapes/dtypes against `spec`; return the resolved dim symbols.

    expect: dims known beforehand (e.g. ref.abi.dims_of(cfg)): a tensor that disagrees with
    one is blamed, instead of taking the first tensor's dims as the truth."""
    dims: dict[str, int] = {}
    known = dict(expect or {})
    finite = []
    for name, shape, cls, role in spec:
        if name not in args:
            raise ArgError(name, "missing")
        t = args[name]
        if t is None:
            if cls == "ws" and fmt in QUANTIZED:
                raise ArgError(name, f"is None: {fmt} experts need scales")
            if role == "opt" or cls == "ws":
                continue
            raise ArgError(name, "is None")
        if not isinstance(t, torch.Tensor):
            raise ArgError(name, f"expected a tensor, got {type(t).__name__}")
        if cls == "ws" and fmt == "bf16":
            raise ArgError(name, "bf16 experts take no scales (pass None)")
        bad = _dtype_ok(name, t, cls, mode, fmt)
        if bad:
            raise ArgError(name, f"dtype {str(t.dtype).replace('torch.', '')}, expected {bad} ({mode} mode)")
        if t.dim() != len(shape):
            raise ArgError(name, f"rank {t.dim()} (shape {tuple(t.shape)}), expected {len(shape)} dims {shape}")
        for sym, n in zip(shape, t.shape):
            if sym == "*":
                continue
            if sym in known and known[sym] != n:
                raise ArgError(name, f"shape {tuple(t.shape)}: dim {sym}={n}, {expect_from} says {known[sym]}")
            if dims.setdefault(sym, n) != n:
                raise ArgError(name, f"shape {tuple(t.shape)}: dim {sym}={n} disagrees with {dims[sym]} "
                                     "from an earlier argument")
        if check_finite and t.is_floating_point() and role != "out":
            # an f64 sum is non-finite iff some element is (bf16/fp32 values cannot overflow it)
            finite.append((name, t.sum(dtype=torch.float64)))
    if finite:  # one device sync for all of them
        sums = torch.stack([f for _, f in finite]).tolist()
        for (name, _), v in zip(finite, sums):
            if not math.isfinite(v):
                raise ArgError(name, "contains NaN or Inf")
    return dims


def dims_of(cfg: Config) -> dict[str, int]:
    """The ABI's dim symbols that a config fixes (per rank)."""
    return {"H": cfg.hidden, "NH": cfg.nh, "HD": cfg.hd, "P": cfg.p, "C": cfg.qkv, "RK": cfg.rank, "W": cfg.conv,
            "NP": cfg.nproj, "NB": cfg.nbmax, "E": cfg.experts, "LAT": cfg.lat, "SI": cfg.si, "SI2": 2 * cfg.si,
            "RI2": 2 * cfg.ri, "UP": cfg.up_n}


# Build-key fields: kind of value and the range a kernel can take.
_POS_INT, _NONNEG_INT, _BOOL, _POS_REAL, _REAL = "a positive int", "an int ≥ 0", "a bool", "a finite real > 0", \
    "a finite real"
_KEY_FIELDS = {
    KdaPreBuild: {"tokens": _POS_INT, "qlen": _POS_INT, "nblocks": _NONNEG_INT, "delta": _BOOL,
                  "state_len": _POS_INT, "eps": _POS_REAL, "out_eps": _POS_REAL, "onorm_eps": _POS_REAL,
                  "lower_bound": _REAL, "write_idx": "an int ≥ -1"},
    K2Build: {"tokens": _POS_INT, "nblocks": _NONNEG_INT, "eps": _POS_REAL, "out_eps": _POS_REAL,
              "ln_eps": _POS_REAL, "reset": _BOOL, "topk": _POS_INT, "situ_beta": _POS_REAL,
              "situ_linear_beta": _POS_REAL, "experts": "an expert format"},
}


def _field_ok(kind: str, v) -> bool:
    if kind == _BOOL:
        return isinstance(v, bool)
    if kind in (_POS_INT, _NONNEG_INT, "an int ≥ -1"):
        lo = {_POS_INT: 1, _NONNEG_INT: 0}.get(kind, -1)
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo
    if kind in (_POS_REAL, _REAL):
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return ok and (kind == _REAL or v > 0)
    return v in EXPERT_FORMATS


def check_key(key) -> None:
    """Every field of a build key has its type and range (ArgError 'key.<field>')."""
    fields = _KEY_FIELDS.get(type(key))
    if fields is None:
        raise ArgError("key", f"expected a KdaPreBuild or K2Build, got {type(key).__name__}")
    for f, kind in fields.items():
        v = getattr(key, f)
        if not _field_ok(kind, v):
            extra = f" ({', '.join(EXPERT_FORMATS)})" if f == "experts" else ""
            raise ArgError(f"key.{f}", f"{v!r} is not {kind}{extra}")


def check_k1(key: KdaPreBuild, a: dict, mode: str = "exact", *, expect: dict | None = None,
             data: bool = True) -> dict[str, int]:
    """The K1 launch rule (DESIGN §5-6): key fields, tensors, key vs tensors, and (with `data`)
    finiteness and slot indices. data=False checks shapes and dtypes only (meta tensors)."""
    check_key(key)
    d = check_args(K1_ARGS, a, mode, check_finite=data, expect=expect)
    S, L = d["S"], key.qlen
    if key.tokens != S:
        raise ArgError("key.tokens", f"{key.tokens} but prefix has {S} rows")
    if S % L:
        raise ArgError("key.qlen", f"{L} does not divide tokens={S}")
    if d["R"] != S // L:
        raise ArgError("st_idx", f"{d['R']} requests, expected tokens/qlen = {S // L}")
    if key.delta != (a["delta"] is not None):
        raise ArgError("delta", f"key.delta={key.delta} but delta is {'None' if a['delta'] is None else 'given'}")
    if key.state_len != d["SL"]:
        raise ArgError("key.state_len", f"{key.state_len} but conv_state has state_len {d['SL']}")
    if d["SL"] < d["W"] - 2 + L:
        raise ArgError("conv_state", f"state_len {d['SL']} < W-2+L = {d['W'] - 2 + L}: too small for the window")
    if not key.nblocks <= d["NB"]:
        raise ArgError("key.nblocks", f"{key.nblocks} outside 0..{d['NB']}")
    if not key.write_idx < d["NB"]:
        raise ArgError("key.write_idx", f"{key.write_idx} outside -1..{d['NB'] - 1}")
    if d["P"] != d["NH"] * d["HD"] or d["C"] != 3 * d["P"]:
        raise ArgError("w_fb", f"P={d['P']}, C={d['C']} inconsistent with NH={d['NH']}, HD={d['HD']}")
    rank = d["RK"]
    if d["NP"] < 4 * d["P"] + rank + d["NH"]:
        raise ArgError("w_in", f"{d['NP']} rows < 4P+RANK+NH = {4 * d['P'] + rank + d['NH']}")
    if d["SW"] < L:
        raise ArgError("st_idx", f"width {d['SW']} < qlen {L}")
    if data:
        check_k1_indices(a["st_idx"], a["num_acc"], L, d["CS"], d["RS"])
    return d


def check_k2(key: K2Build, a: dict, mode: str = "exact", *, rank: int = 0, world: int | None = None,
             expect: dict | None = None, data: bool = True) -> dict[str, int]:
    """The K2 launch rule of one rank (DESIGN §5-7): key fields, tensors, key vs tensors, the
    world split (`world`: the collective's size) and the expert format's packing."""
    check_key(key)
    d = check_args(K2_ARGS, a, mode, key.experts, check_finite=data, expect=expect)
    if key.tokens != d["S"]:
        raise ArgError("key.tokens", f"{key.tokens} but prefix has {d['S']} rows")
    if not key.nblocks <= d["NB"]:
        raise ArgError("key.nblocks", f"{key.nblocks} outside 0..{d['NB']}")
    if not key.topk <= d["E"]:
        raise ArgError("key.topk", f"{key.topk} outside 1..E={d['E']}")
    if world is not None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
            raise ArgError("rank", f"{rank!r} outside 0..{world - 1}")
        if d["UP"] * world != d["H"]:
            raise ArgError("w_up", f"{d['UP']} rows × world {world} != hidden {d['H']}")
    fmt, lat, ri2 = key.experts, d["LAT"], d["RI2"]
    expect_multiple("w13", lat, 32)
    expect_multiple("w2", ri2 // 2, 32)
    want13 = lat if fmt == "bf16" else lat // 2
    want2 = ri2 // 2 if fmt == "bf16" else ri2 // 4
    if a["w13"].shape[2] != want13:
        raise ArgError("w13", f"last dim {a['w13'].shape[2]}, expected {want13} for {fmt}")
    if a["w2"].shape[2] != want2:
        raise ArgError("w2", f"last dim {a['w2'].shape[2]}, expected {want2} for {fmt}")
    if fmt != "bf16":
        for n, k in (("w13s", lat), ("w2s", ri2 // 2)):
            if a[n].shape[2] != k // 32:
                raise ArgError(n, f"last dim {a[n].shape[2]}, expected {k // 32} (one scale per 32)")
    return d


def check_k1_indices(st_idx: torch.Tensor, num_acc: torch.Tensor, L: int, conv_slots: int,
                     rec_slots: int) -> None:
    if st_idx.shape[1] < L:
        raise ArgError("st_idx", f"width {st_idx.shape[1]} < qlen {L}")
    na = num_acc.tolist()
    for r, a in enumerate(na):
        if not 1 <= a <= L:
            raise ArgError("num_acc", f"num_acc[{r}] = {a} outside 1..{L}")
    idx = st_idx[:, :L]
    if int(idx.max()) >= rec_slots:
        raise ArgError("st_idx", f"slot {int(idx.max())} outside the recurrent cache ({rec_slots} slots)")
    if int(st_idx[:, 0].max()) >= conv_slots:
        raise ArgError("st_idx", f"conv slot {int(st_idx[:, 0].max())} outside the conv cache ({conv_slots} slots)")


def expect_multiple(field: str, n: int, m: int) -> None:
    if n % m:
        raise ArgError(field, f"dim {n} must be a multiple of {m}")


def oracle_args(kwargs: dict) -> dict:
    """Launch kwargs for oracle mode: state, activations and outputs as float64 copies; the
    read-only weights as they are (no copy: the reference upcasts them exactly at use)."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            out[k] = v if k in _WEIGHTS else (v.double() if v.is_floating_point() else v.clone())
        elif isinstance(v, dict) and k != "taps":
            out[k] = oracle_args(v)
        else:
            out[k] = v
    return out


__all__ = ["K1_ARGS", "K2_ARGS", "K1_NAMES", "K2_NAMES", "K1_WEIGHTS", "K2_WEIGHTS", "K1_TAPS", "K2_TAPS",
           "TAP_DIMS", "ArgError", "check_args", "check_key", "check_k1", "check_k2", "check_k1_indices",
           "dims_of", "expect_multiple", "oracle_args"]
