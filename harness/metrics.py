"""Error metrics of one compared tensor (DESIGN §9).

API (what the replay calls):

    compare(a, b, dims=None, atol=1e-2, rtol=1.6e-2, atol_rms=0.0, detail=True) -> dict
        a = candidate (backend, or perturbed reference), b = reference (or oracle).
        Pass the tolerances of `Policy.compare_kw`; detail=False (no locations or
        histograms, ~3x faster) is enough for oracle and noise comparisons.
        Same shape required (`ShapeMismatch` otherwise); dtypes may differ (an fp64
        oracle against a bf16 output). `dims`: names of a's dims, or a tap/output name
        looked up in `ref.abi.TAP_DIMS`; used for `worst` locations.
    compare_routing(ids_a, ids_b, keys, tie_eps, ...) -> dict
        top-k ids as sets per token; `keys` [S, E] are the oracle's router keys
        (sigmoid(logits) + bias, float64). The result is compare(ids_a, ids_b) plus
        the routing fields below; `judge` reads `untied_tokens`.
    align_by_ids(ids_a, vals_a, ids_b) -> vals_a reordered to ids_b's order per token
        (to compare topk_w elementwise when the sets agree but the order differs).

Keys of the dict `compare` returns (all plain Python values, JSON-ready):

    n, shape, dtype_a, dtype_b, dtype_match
    exact        bool: same dtype and every element bit-identical. NaN payloads and
                 the sign of zero count: bookkeeping outputs are copies and a copy keeps
                 bits. Integer/bool tensors: equal values.
    n_differ     elements not bit-identical (value-unequal when the dtypes differ)
    exact_frac   fraction of elements equal in value (NaN == NaN, +0 == -0)
    max_abs, mean_abs          over elements finite on both sides
    rel_l2       ||a-b|| / ||b||; 0 when both are zero, inf when only b is
    cosine       <a,b> / (|a||b|); 1 when both are zero, 0 when exactly one is
    sqnr_db      10 log10(sum b^2 / sum (a-b)^2); +inf when a == b, -inf when b == 0 != a
    calc_diff    1 - 2 sum ab / sum (a^2 + b^2); 0 when both are zero
    scale_err    sum ab / sum b^2 - 1: the least-squares gain of a over b, minus 1. Random
                 rounding noise averages out of it (std ~ rel_l2 / sqrt(n)), a systematic
                 scale error does not; 0 when b is all zero (no gain defined; rel_l2
                 is inf then)
    max_ulp      max |a-b| / ulp, ulp = the bf16 spacing at max(|bf16(b)|, 2^-8 rms(b))
                 (`bf16_ulp`, `ULP_FLOOR_RMS`). The floor defines the ulp of a zero
                 reference: an output element 256x below its tensor's RMS (a zero, or a
                 cancellation) carries the absolute error of the operands that made it,
                 so it is measured at that scale, not in its own (arbitrarily small)
                 ulps. All-zero references get the subnormal spacing 2^-133 (any error
                 is huge). Integers: max |a-b|.
    mismatch_frac  fraction failing |a-b| <= atol + atol_rms rms(b) + rtol |b| (NaN matches
                 NaN, inf the same inf; rms over b's finite elements)
    atol, rtol, atol_rms   the tolerances mismatch_frac used
    nan_a, inf_a, nan_b, inf_b  counts
    ref_absmax, ref_rms         scale of b (finite elements)
    worst, worst_a, worst_b     location ({dim name: index}) and values of the largest
                 |a-b|; a non-finite disagreement, if any, is worse than any number.
                 None when a and b are equal everywhere.
    worst_ulp    location of the largest ulp error (None when max_ulp == 0)
    ulp_hist     counts of per-element ulp error in `ULP_BINS` (fixed: sums across
                 comparisons are meaningful)
    mag_err      {"count", "max_abs"}: elements and their largest |a-b| per bin of |b|
                 (`MAG_BINS`), for error-vs-magnitude plots

Metrics are computed in float64 (exact for bf16/fp32 inputs and int32 ids), on the device the
candidate lives on: `compare_lazy` leaves them there, `resolve(pending)` brings any number of
them to the host in one transfer (a replay step judges all its pairs with one sync).
Empty tensors compare as equal: errors 0, cosine 1, exact True.
"""
from __future__ import annotations

import math

import numpy as np
import torch

F64 = torch.float64

# Lower is better unless listed in HIGHER_IS_BETTER.
SCALAR_METRICS = ("max_abs", "mean_abs", "rel_l2", "cosine", "sqnr_db", "calc_diff", "scale_err",
                  "max_ulp", "mismatch_frac", "exact_frac", "n_differ", "nan_a", "inf_a")
HIGHER_IS_BETTER = frozenset({"cosine", "sqnr_db", "exact_frac"})

# ulp-error histogram: bin 0 = exactly 0; then (0, .5], (.5, 1], (1, 2], ... (4096, 65536],
# > 65536; last bin = a non-finite disagreement.
ULP_EDGES = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 256.0, 4096.0, 65536.0)
ULP_BINS = ("0",) + tuple(f"<={e:g}" for e in ULP_EDGES) + (f">{ULP_EDGES[-1]:g}", "nonfinite")
# |b| magnitude bins: exactly 0, then decades (0, 1e-6], (1e-6, 1e-5], ... (1e3, 1e4], > 1e4.
MAG_EDGES = tuple(10.0 ** k for k in range(-6, 5))
MAG_BINS = ("0",) + tuple(f"<=1e{k}" for k in range(-6, 5)) + (">1e4",)

ULP_FLOOR_RMS = 2.0 ** -8  # ulps are measured at no less than this fraction of rms(b)
_BF16_MIN_EXP = -126  # bf16 keeps fp32's exponent range
_BF16_MANT = 7  # stored mantissa bits
_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}


class ShapeMismatch(ValueError):
    pass


def _t(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach()
    return torch.as_tensor(x)


def dim_names(dims, ndim: int) -> tuple[str, ...]:
    """Names of `ndim` dims: `dims` as a sequence, a TAP_DIMS key, or None -> d0, d1..."""
    if isinstance(dims, str):
        from ref.abi import TAP_DIMS

        dims = TAP_DIMS.get(dims)
    if dims is None or len(dims) != ndim:
        return tuple(f"d{i}" for i in range(ndim))
    return tuple(dims)


def locate(flat_index: int, shape, names) -> dict[str, int]:
    """Flat (row-major) index -> {dim name: index}."""
    out, rem = {}, int(flat_index)
    for size, name in zip(reversed(tuple(shape)), reversed(names)):
        rem, out[name] = divmod(rem, size) if size else (rem, 0)
    return {n: out[n] for n in names}


def bf16_ulp(b, floor: float = 0.0) -> np.ndarray:
    """Spacing of bf16 values at max(|bf16(b)|, floor), float64 array of b's shape (b finite).
    A numpy `b` is taken as already bf16-valued.

    ulp = 2^(e - 7) with e = floor(log2 max(|bf16(b)|, floor)) clamped to [-126, 127]: a
    zero (or subnormal) reference below `floor` gets the spacing at `floor`, and with
    floor = 0 the subnormal spacing 2^-133.
    """
    # The ulp is that of the reference's bf16 value: round it first (RNE, via torch).
    rb = np.abs(b) if isinstance(b, np.ndarray) else np.abs(_t(b).to(torch.bfloat16).to(F64).cpu().numpy())
    if floor > 0:
        rb = np.maximum(rb, floor)
    # floor(log2 rb) from the float64 exponent field (0 and subnormals give <= -1023)
    e = ((rb.view(np.int64) >> 52) & 0x7FF) - 1023
    e = np.minimum(np.maximum(e, _BF16_MIN_EXP), 127)  # bf16 keeps fp32's exponent range; inf -> largest binade
    return ((e - _BF16_MANT + 1023) << 52).view(np.float64)


def _empty(a, b, atol, rtol, atol_rms) -> dict:
    return dict(n=0, shape=list(a.shape), dtype_a=_dn(a), dtype_b=_dn(b), dtype_match=a.dtype == b.dtype,
                exact=a.dtype == b.dtype, n_differ=0, exact_frac=1.0, max_abs=0.0, mean_abs=0.0,
                rel_l2=0.0, cosine=1.0, sqnr_db=math.inf, calc_diff=0.0, scale_err=0.0, max_ulp=0.0,
                mismatch_frac=0.0, atol=atol, rtol=rtol, atol_rms=atol_rms, nan_a=0, inf_a=0, nan_b=0,
                inf_b=0, ref_absmax=0.0, ref_rms=0.0, worst=None, worst_a=None, worst_b=None, worst_ulp=None,
                ulp_hist=[0] * len(ULP_BINS), mag_err=_mag_empty())


def _dn(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _mag_empty() -> dict:
    k = len(MAG_BINS)
    return {"count": [0] * k, "max_abs": [0.0] * k}


def _ratio(num: float, den: float, both_zero: float, den_zero: float) -> float:
    if den > 0:
        return num / den
    return both_zero if num == 0 else den_zero


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Storage bits (floats) or values (ints/bools), flat."""
    t = t.reshape(-1).contiguous()
    if t.is_floating_point():
        t = t.view(_INT_VIEW[t.element_size()])
    return t


def bf16_ulp_t(rb: torch.Tensor) -> torch.Tensor:
    """bf16 spacing at |bf16 values| rb (float64 in and out), on rb's device."""
    return _ulp_t(rb.to(F64))


def _ulp_t(rb: torch.Tensor) -> torch.Tensor:
    """bf16 spacing at rb = |bf16 value| (float64, >= 0, may be 0/inf): 2^(e-7), e = floor(log2 rb)
    clamped to [-126, 127], from the float64 exponent field (exact on every device)."""
    e = ((rb.view(torch.int64) >> 52) & 0x7FF) - 1023
    e = e.clamp(_BF16_MIN_EXP, 127)
    return ((e - _BF16_MANT + 1023) << 52).view(F64)


# Layout of the device-side result vector of one comparison (float64; counts and indices are
# exact below 2^53). One host transfer resolves any number of pending comparisons.
_NU, _NH, _NM = 17, len(ULP_BINS), len(MAG_BINS)
_SCAL = ("n_eq", "n_differ", "nan_a", "nan_b", "inf_a", "inf_b", "sum_d2", "sum_b2", "sum_a2", "sum_ab",
         "max_d", "sum_d", "n_fin", "max_ulp", "n_ok", "absmax_y", "any_bad")
_DET = ("wi", "wa", "wb", "wu")
def _bin(v: torch.Tensor, edges) -> torch.Tensor:
    """1 + the number of edges below v (searchsorted, left), one compare per edge."""
    out = torch.ones(v.shape, dtype=torch.int64, device=v.device)
    for e in edges:
        out += v > e
    return out


class Pending:
    """A comparison whose numbers are still on the device: `resolve([...])` brings many home
    in one transfer."""

    def __init__(self, vec, meta: dict, empty: dict | None = None):
        self.vec, self.meta, self.empty = vec, meta, empty

    def result(self, host: list[float] | None = None) -> dict:
        if self.empty is not None:
            return self.empty
        return _decode(host if host is not None else self.vec.cpu().tolist(), self.meta)


def resolve(pending: list) -> list[dict]:
    """The dicts of many Pending comparisons, with one device-to-host transfer per device."""
    out: list = [None] * len(pending)
    by_dev: dict = {}
    for i, p in enumerate(pending):
        if p.empty is not None:
            out[i] = p.empty
        else:
            by_dev.setdefault(p.vec.device, []).append(i)
    for dev, idx in by_dev.items():
        host = torch.cat([pending[i].vec for i in idx]).cpu().tolist()
        pos = 0
        for i in idx:
            n = pending[i].vec.numel()
            out[i] = pending[i].result(host[pos:pos + n])
            pos += n
    return out


def compare_lazy(a, b, dims=None, atol: float = 1e-2, rtol: float = 1.6e-2, atol_rms: float = 0.0,
                 detail: bool = True, ulp_unit=None) -> Pending:
    """`compare` without the host transfer: every metric is computed where `a` lives (b is moved
    there if it is elsewhere) into one float64 vector; `resolve` turns it into the dict.

    ulp_unit: b's shape, float64: the smallest unit max_ulp counts in per element (a sum of
    rounded operands errs in the operands' ulps, not in the sum's: see `harness.isolate`)."""
    return compare_many([(a, b, ulp_unit)], dims, atol, rtol, atol_rms, detail)[0]


BATCH_ELEMS = 1 << 24  # elements per batched pass (bounds the float64 temporaries, ~128 MiB each)


def compare_many(items, dims=None, atol: float = 1e-2, rtol: float = 1.6e-2, atol_rms: float = 0.0,
                 detail: bool = True) -> list[Pending]:
    """`compare_lazy` of many (a, b, ulp_unit) at once: items of one shape and dtypes on one
    device are stacked and computed in one pass (the judge is launch-bound: ~50 small ops a
    comparison), each row's numbers the same as alone."""
    out: list = [None] * len(items)
    groups: dict = {}
    for i, (a, b, unit) in enumerate(items):
        a, b = _checked(a, b, unit)
        if b.device != a.device:
            b = b.to(a.device)
        meta = dict(n=a.numel(), shape=list(a.shape), names=dim_names(dims, a.dim()), dtype_a=_dn(a), dtype_b=_dn(b),
                    dtype_match=a.dtype == b.dtype, is_float=a.is_floating_point(),
                    is_int=not (a.is_floating_point() or b.is_floating_point()),
                    atol=float(atol), rtol=float(rtol), atol_rms=float(atol_rms), detail=detail)
        if a.numel() == 0:
            out[i] = Pending(None, meta, _empty(a, b, float(atol), float(rtol), float(atol_rms)))
            continue
        g = groups.setdefault((tuple(a.shape), a.dtype, b.dtype, a.device, unit is None), [])
        g.append((i, a, b, unit, meta))
    for g in groups.values():
        per = max(1, BATCH_ELEMS // g[0][4]["n"])
        for lo in range(0, len(g), per):
            part = g[lo:lo + per]
            vecs = _stats([x[1] for x in part], [x[2] for x in part],
                          None if part[0][3] is None else [x[3] for x in part], part[0][4], atol, rtol, atol_rms,
                          detail)
            for (i, *_, meta), v in zip(part, vecs):
                out[i] = Pending(v, meta)
    return out


def _checked(a, b, unit=None):
    """(a, b) as tensors of one shape (and `unit` of theirs), else ShapeMismatch."""
    a, b = _t(a), _t(b)
    if tuple(a.shape) != tuple(b.shape):
        raise ShapeMismatch(f"shape {tuple(a.shape)} (candidate) != {tuple(b.shape)} (reference)")
    if unit is not None and tuple(unit.shape) != tuple(b.shape):
        raise ShapeMismatch(f"ulp unit shape {tuple(unit.shape)} != {tuple(b.shape)} (reference)")
    return a, b


class Batch:
    """Comparisons gathered, then computed together (`compare_many` per kind) and resolved in
    one transfer per device: `i = batch.add(a, b, dims, ...)`, later `batch.run()[i]`."""

    def __init__(self):
        self._items: list = []

    def add(self, a, b, dims=None, atol: float = 1e-2, rtol: float = 1.6e-2, atol_rms: float = 0.0,
            detail: bool = True, ulp_unit=None) -> int:
        a, b = _checked(a, b, ulp_unit)
        self._items.append(((dims if not isinstance(dims, list) else tuple(dims), float(atol), float(rtol),
                             float(atol_rms), bool(detail)), (a, b, ulp_unit)))
        return len(self._items) - 1

    def run(self) -> list[dict]:
        kinds: dict = {}
        for i, (k, item) in enumerate(self._items):
            kinds.setdefault(k, []).append((i, item))
        pend: list = [None] * len(self._items)
        for (dims, atol, rtol, atol_rms, detail), its in kinds.items():
            for (i, _), p in zip(its, compare_many([x for _, x in its], dims, atol, rtol, atol_rms, detail)):
                pend[i] = p
        return resolve(pend)


def _stats(As, Bs, units, meta, atol, rtol, atol_rms, detail) -> torch.Tensor:
    """The result vectors [R, ·] of R comparisons of one shape (rows of fa/fb)."""
    R = len(As)
    fa = torch.stack([a.reshape(-1) for a in As]).to(F64)
    fb = torch.stack([b.reshape(-1) for b in Bs]).to(F64)
    dev = fa.device
    nan_a, nan_b = torch.isnan(fa), torch.isnan(fb)
    inf_a, inf_b = torch.isinf(fa), torch.isinf(fb)
    value_eq = (fa == fb) | (nan_a & nan_b)
    fin = torch.isfinite(fa) & torch.isfinite(fb)
    nonfin_bad = ~fin & ~value_eq  # one side non-finite and not the same value
    n = fa.shape[1]
    n_eq = value_eq.sum(1, dtype=F64)  # counts as float64 (exact below 2^53): one stack, no casts
    if not meta["dtype_match"]:
        n_differ = n - n_eq
    else:
        n_differ = (torch.stack([_bits(a) for a in As]) != torch.stack([_bits(b) for b in Bs])).sum(1, dtype=F64)
    zero = torch.zeros((), dtype=F64, device=dev)
    x, y = torch.where(fin, fa, zero), torch.where(fin, fb, zero)
    d = (x - y).abs()
    n_fin = fin.sum(1, dtype=F64)
    sum_d2, sum_b2, sum_a2, sum_ab = (d * d).sum(1), (y * y).sum(1), (x * x).sum(1), (x * y).sum(1)
    any_bad = nonfin_bad.any(1)
    # ulps of the reference, floored at ULP_FLOOR_RMS * rms(b) (see module doc)
    rms = torch.sqrt(sum_b2 / n_fin.clamp_min(1))[:, None]
    if meta["is_int"]:
        ulp_full = d
    else:
        rb = y.abs() if Bs[0].dtype == torch.bfloat16 else y.to(torch.bfloat16).to(F64).abs()
        unit = _ulp_t(torch.maximum(rb, ULP_FLOOR_RMS * rms))
        if units is not None:
            unit = torch.maximum(unit, torch.stack([_t(u).reshape(-1) for u in units]).to(device=dev, dtype=F64))
        ulp_full = d / unit
    ulp_full = torch.where(nonfin_bad, torch.full_like(ulp_full, math.inf), ulp_full)
    absy = y.abs()
    n_ok = ((d <= atol + atol_rms * rms + rtol * absy) & fin).sum(1, dtype=F64) + (value_eq & ~fin).sum(1, dtype=F64)
    parts = [n_eq, n_differ, nan_a.sum(1, dtype=F64), nan_b.sum(1, dtype=F64), inf_a.sum(1, dtype=F64),
             inf_b.sum(1, dtype=F64), sum_d2, sum_b2, sum_a2, sum_ab, d.amax(1), d.sum(1), n_fin, ulp_full.amax(1),
             n_ok, absy.amax(1), any_bad.to(F64)]
    vec = [torch.stack(parts, dim=1)]
    if detail:
        wi = torch.where(any_bad, torch.argmax(nonfin_bad.to(torch.int8), dim=1), torch.argmax(d, dim=1))
        wu = torch.argmax(ulp_full, dim=1)
        vec.append(torch.stack([wi.to(F64), fa.gather(1, wi[:, None])[:, 0], fb.gather(1, wi[:, None])[:, 0],
                                wu.to(F64)], dim=1))
        rows = torch.arange(R, device=dev)[:, None]
        bins = _bin(ulp_full, ULP_EDGES)
        bins = torch.where(ulp_full == 0, torch.zeros_like(bins), bins)
        bins = torch.where(nonfin_bad, torch.full_like(bins, _NH - 1), bins)
        vec.append(torch.bincount((bins + rows * _NH).reshape(-1), minlength=R * _NH).view(R, _NH).to(F64))
        mb = _bin(absy, MAG_EDGES)
        mb = torch.where(absy == 0, torch.zeros_like(mb), mb)
        vec.append(torch.bincount((mb + rows * _NM).reshape(-1), weights=fin.to(F64).reshape(-1),
                                  minlength=R * _NM).view(R, _NM).to(F64))
        vec.append(torch.zeros(R, _NM, dtype=F64, device=dev).scatter_reduce(1, mb, d, "amax"))
    return torch.cat(vec, dim=1)


def _decode(v: list[float], meta: dict) -> dict:
    s = dict(zip(_SCAL, v[:_NU]))
    n = meta["n"]
    any_bad = s["any_bad"] > 0
    n_fin = int(s["n_fin"])
    sum_d2, sum_b2, sum_a2, sum_ab = s["sum_d2"], s["sum_b2"], s["sum_a2"], s["sum_ab"]
    max_abs = math.inf if any_bad else (s["max_d"] if n_fin else 0.0)
    rel_l2 = _ratio(math.sqrt(sum_d2), math.sqrt(sum_b2), 0.0, math.inf)
    na, nb = math.sqrt(sum_a2), math.sqrt(sum_b2)
    if na > 0 and nb > 0:
        cosine = max(-1.0, min(1.0, sum_ab / (na * nb)))
    else:
        cosine = 1.0 if na == nb else 0.0
    if sum_d2 == 0:
        sqnr = math.inf
    elif sum_b2 == 0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(sum_b2 / sum_d2)
    n_differ = int(s["n_differ"])
    out = dict(
        n=n, shape=meta["shape"], dtype_a=meta["dtype_a"], dtype_b=meta["dtype_b"], dtype_match=meta["dtype_match"],
        exact=meta["dtype_match"] and n_differ == 0, n_differ=n_differ, exact_frac=s["n_eq"] / n,
        max_abs=max_abs, mean_abs=s["sum_d"] / n_fin if n_fin else 0.0, rel_l2=rel_l2, cosine=cosine,
        sqnr_db=sqnr, calc_diff=_ratio(sum_a2 + sum_b2 - 2.0 * sum_ab, sum_a2 + sum_b2, 0.0, 0.0),
        scale_err=_ratio(sum_ab - sum_b2, sum_b2, 0.0, math.inf), max_ulp=s["max_ulp"],
        mismatch_frac=(n - s["n_ok"]) / n, atol=meta["atol"], rtol=meta["rtol"],
        nan_a=int(s["nan_a"]), inf_a=int(s["inf_a"]), nan_b=int(s["nan_b"]), inf_b=int(s["inf_b"]),
        ref_absmax=s["absmax_y"] if n_fin else 0.0, ref_rms=math.sqrt(sum_b2 / n_fin) if n_fin else 0.0,
        atol_rms=meta["atol_rms"],
    )
    if not meta["detail"]:
        return out
    wi, wa, wb, wu = v[_NU:_NU + 4]
    p = _NU + 4
    hist = [int(c) for c in v[p:p + _NH]]
    cnt = [int(c) for c in v[p + _NH:p + _NH + _NM]]
    mx = [float(c) for c in v[p + _NH + _NM:p + _NH + 2 * _NM]]
    differs = any_bad or max_abs > 0
    shape, names = meta["shape"], meta["names"]
    out.update(worst=locate(int(wi), shape, names) if differs else None,
               worst_a=float(wa) if differs else None, worst_b=float(wb) if differs else None,
               worst_ulp=locate(int(wu), shape, names) if out["max_ulp"] > 0 else None,
               ulp_hist=hist, mag_err={"count": cnt, "max_abs": mx})
    return out


def compare(a, b, dims=None, atol: float = 1e-2, rtol: float = 1.6e-2, atol_rms: float = 0.0,
            detail: bool = True) -> dict:
    """Metrics of candidate `a` against reference `b` (any equal shape). See module doc.

    detail=False leaves out worst locations, ulp_hist and mag_err: enough for oracle and noise
    comparisons, which only feed ratios. Computed on a's device; one host transfer."""
    return compare_lazy(a, b, dims, atol, rtol, atol_rms, detail).result()


def scalars(m: dict) -> dict:
    """The scalar metrics of a compare() dict (no histograms, no locations)."""
    keep = set(SCALAR_METRICS) | {"n", "exact", "dtype_match", "nan_b", "inf_b", "ref_absmax", "ref_rms"}
    return {k: v for k, v in m.items() if k in keep}


TIE_M = 2.0  # a backend's key may sit as far from the oracle's as the reference's, on the other side


def compare_routing(ids_a, ids_b, keys, tie_eps: float, dims="topk_ids", key_err=None) -> dict:
    """Top-k picks of candidate `ids_a` vs reference `ids_b`, [S, K] ints, as sets per token.

    A token whose sets differ is *tied* when every expert in the symmetric difference has
    an oracle key within the token's window of the oracle's K-th largest key of that token
    (the boundary): then either choice is right and downstream stages are judged with the
    reference forced to the candidate's picks. The window is `tie_eps` (the policy's cap); with
    `key_err` [S, E] (|key_ref - key_oracle|, the reference's own key error) it narrows per
    token to TIE_M x the largest key error among the swapped experts and the K-th one.
    Keys added to compare(ids_a, ids_b): sets_equal (bool), set_diff_tokens, tied_tokens (list:
    force these), untied_tokens (count; must be 0), untied_list, boundary_gap (max over
    differing tokens of the largest |key - K-th key| among swapped experts), tie_eps,
    tie_window (the widest window a differing token got).
    """
    ia, ib = _t(ids_a).to(torch.int64), _t(ids_b).to(torch.int64)
    m = compare(ia, ib, dims=dims)
    kk = _t(keys).to(F64).cpu()
    ke = None if key_err is None else _t(key_err).to(F64).cpu()
    ia, ib = ia.cpu(), ib.cpu()
    if kk.dim() != 2 or kk.shape[0] != ia.shape[0]:
        raise ShapeMismatch(f"keys shape {tuple(kk.shape)} does not match ids {tuple(ia.shape)}")
    K = ia.shape[1] if ia.dim() == 2 else 0
    tied, untied, gap_max, win_max = [], [], 0.0, 0.0
    for t in range(ia.shape[0]):
        sa, sb = set(ia[t].tolist()), set(ib[t].tolist())
        sym = sa ^ sb
        if not sym:
            continue
        top = torch.topk(torch.nan_to_num(kk[t], nan=-math.inf), K)
        kth, kth_e = float(top.values[-1]), int(top.indices[-1])
        bad = [e for e in sym if not 0 <= e < kk.shape[1]]
        gap = math.inf if bad else max(abs(float(kk[t, e]) - kth) for e in sym)
        if math.isnan(gap):
            gap = math.inf
        win = tie_eps
        if ke is not None and not bad:
            own = max(float(ke[t, e]) for e in sym | {kth_e})
            win = min(tie_eps, TIE_M * own) if math.isfinite(own) else tie_eps
        gap_max, win_max = max(gap_max, gap), max(win_max, win)
        (tied if gap <= win else untied).append(t)
    m.update(sets_equal=not (tied or untied), set_diff_tokens=len(tied) + len(untied), tied_tokens=tied,
             untied_tokens=len(untied),
             untied_list=untied, boundary_gap=gap_max, tie_eps=float(tie_eps), tie_window=win_max)
    return m


def compare_picks(ids_a, ids_b, logits, bias, tie_eps: float, dims="topk_ids") -> dict:
    """Top-k picks of candidate `ids_a` vs reference `ids_b` [S, K] made from the same fp32
    `logits` [S, E] (the isolated view). The reference keys key = fp32(σ(logit) + bias) order
    them; a correct kernel's own σ may sit a few fp32 ulps away, so a token passes when its
    candidate picks are a top-k under keys moved by at most `tie_eps`:
    - K distinct experts, each missing or extra one within tie_eps of the K-th key;
    - every earlier pick's key >= every later pick's key - tie_eps;
    - among experts with bit-identical logit and bias (equal keys in any implementation)
      the lowest ids picked, in ascending order.
    Adds to compare(ids_a, ids_b) the keys judge reads as routing: set_diff_tokens (tokens
    whose picks differ), untied_tokens (tokens that fail, must be 0), untied_list,
    boundary_gap (the largest key gap a passing difference spans), tie_eps."""
    ia, ib = _t(ids_a).to(torch.int64).cpu(), _t(ids_b).to(torch.int64).cpu()
    m = compare(ia, ib, dims=dims)
    lg = _t(logits).to(torch.float32).cpu()
    bs = _t(bias).to(torch.float32).cpu()
    key = (torch.sigmoid(lg) + bs).to(F64)
    key = torch.where(torch.isnan(key), torch.full_like(key, -math.inf), key)
    E = key.shape[1]
    K = ia.shape[1] if ia.dim() == 2 else 0
    differ, bad, gap_max = 0, [], 0.0
    for t in range(ia.shape[0]):
        la, lb = ia[t].tolist(), ib[t].tolist()
        if la == lb:
            continue
        differ += 1
        if len(set(la)) != K or not all(0 <= e < E for e in la):
            bad.append(t)
            continue
        kth = float(key[t, lb[-1]])
        gap = max([abs(float(key[t, e]) - kth) for e in set(la) ^ set(lb)], default=0.0)
        kc = key[t, la]
        later_above = (kc[None, :] - kc[:, None]).triu(1)  # [i, j]: key of later pick j above earlier i
        gap = max(gap, float(later_above.max()))
        twin = (lg[t, la][:, None] == lg[t, la][None, :]) & (bs[la][:, None] == bs[la][None, :])
        ids_t = torch.tensor(la)
        twin_desc = bool((twin & (ids_t[:, None] > ids_t[None, :])).triu(1).any())
        for c in la:  # a pick whose lower-id twin was left out
            tw = ((lg[t] == lg[t, c]) & (bs == bs[c])).nonzero().flatten().tolist()
            twin_desc |= any(e < c and e not in la for e in tw)
        if gap > tie_eps or twin_desc or math.isnan(gap):
            bad.append(t)
        else:
            gap_max = max(gap_max, gap)
    m.update(sets_equal=not differ, set_diff_tokens=differ, tied_tokens=[], untied_tokens=len(bad),
             untied_list=bad, boundary_gap=gap_max, tie_eps=float(tie_eps), tie_window=float(tie_eps))
    return m


def align_by_ids(ids_a, vals_a, ids_b) -> torch.Tensor:
    """vals_a [S, K] reordered per token so its ids follow ids_b's order.

    Tokens whose id sets differ keep their order (compare them as routing differences).
    """
    ia, ib, va = _t(ids_a), _t(ids_b), _t(vals_a).clone()
    for t in range(ia.shape[0]):
        la, lb = ia[t].tolist(), ib[t].tolist()
        if la != lb and sorted(la) == sorted(lb) and len(set(la)) == len(la):
            va[t] = va[t][torch.tensor([la.index(e) for e in lb])]
    return va


__all__ = ["compare", "compare_lazy", "compare_many", "Batch", "resolve", "Pending", "compare_routing", "compare_picks", "scalars", "align_by_ids", "bf16_ulp", "bf16_ulp_t", "dim_names", "locate",
           "ShapeMismatch", "SCALAR_METRICS", "HIGHER_IS_BETTER", "ULP_EDGES", "ULP_BINS",
           "MAG_EDGES", "MAG_BINS"]
