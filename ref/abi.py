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


def _dtype_ok(t: torch.Tensor, cls: str, mode: str, fmt: str | None) -> str | None:
    """None if t's dtype fits its class, else the expected dtype in words."""
    fl = F64 if mode == "oracle" else None
    if cls == "act":
        want = (fl or BF16,)
    elif cls == "f32":
        want = (fl or F32,)
    elif cls == "w32":
        want = (fl,) if fl else (F32, BF16)
    elif cls == "i32":
        want = (I32,)
    elif cls == "w":
        want = (U8,) if fmt in QUANTIZED else (fl or BF16,)
    elif cls == "ws":
        want = {"mxfp4": (U8,), "a8w4": (U8,), "int4": (fl or BF16,)}.get(fmt, ())
    else:  # pragma: no cover
        raise AssertionError(cls)
    if t.dtype in want:
        return None
    return " or ".join(str(w).replace("torch.", "") for w in want) or "None"


def check_args(spec, args: dict, mode: str = "exact", fmt: str | None = None,
               check_finite: bool = True) -> dict[str, int]:
    """Validate shapes/dtypes against `spec`; return the resolved dim symbols."""
    dims: dict[str, int] = {}
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
        bad = _dtype_ok(t, cls, mode, fmt)
        if bad:
            raise ArgError(name, f"dtype {str(t.dtype).replace('torch.', '')}, expected {bad} ({mode} mode)")
        if t.dim() != len(shape):
            raise ArgError(name, f"rank {t.dim()} (shape {tuple(t.shape)}), expected {len(shape)} dims {shape}")
        for sym, n in zip(shape, t.shape):
            if sym == "*":
                continue
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


__all__ = ["K1_ARGS", "K2_ARGS", "K1_NAMES", "K2_NAMES", "K1_TAPS", "K2_TAPS", "TAP_DIMS",
           "ArgError", "check_args", "check_k1_indices", "expect_multiple"]
