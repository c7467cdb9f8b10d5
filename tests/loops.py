"""An independent, deliberately plain version of every K1/K2 stage (DESIGN §5, §7).

Written straight from the contract text, not from `ref/`: python loops over output
elements, float64 arithmetic, inner products as correctly rounded sums
(`math.fsum` of exact float64 products). The contract's bf16 rounding points are
kept (`bf16()` below); everything between them is float64, so a loop value differs
from an fp32 reference only where fp32 accumulation tips a bf16 rounding at a
near-tie. Quantization steps (E2M1/E8M0 codes) are implemented from their bit
definitions.

Inputs are numpy float64 arrays (`f64(tensor)` converts exactly) or ints.
"""
from __future__ import annotations

import math

import numpy as np
import torch

L2_EPS = 1e-6
QBLOCK = 32


# ---------------------------------------------------------------- numbers

def f64(t) -> np.ndarray:
    """torch tensor (any float dtype) -> numpy float64, exact."""
    if isinstance(t, np.ndarray):
        return t.astype(np.float64)
    return t.detach().cpu().to(torch.float64).numpy()


def bf16(x) -> np.ndarray:
    """Round float64 values to the nearest bf16 (8 significant bits, ties to even); float64 out."""
    x = np.asarray(x, dtype=np.float64)
    m, e = np.frexp(x)  # x = m·2^e, 0.5 <= |m| < 1
    q = np.maximum(e - 8, -133)  # ulp exponent; bf16 subnormals bottom out at 2^-133
    r = np.rint(np.ldexp(x, -q))  # np.rint rounds half to even
    out = np.ldexp(r, q)
    return np.where(np.abs(out) > 3.3895313892515355e38, np.copysign(np.inf, x), out)


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def dot(a, b) -> float:
    """Σ a_i·b_i, correctly rounded (bf16·bf16 and fp32·bf16 products are exact in float64)."""
    return math.fsum(np.asarray(a, np.float64) * np.asarray(b, np.float64))


def sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    ez = math.exp(z)
    return ez / (1.0 + ez)


def silu(z: float) -> float:
    return z * sigmoid(z)


def situ(g: float, u: float, beta: float, lam: float) -> float:
    """SiTU(g, u) = β·tanh(g/β)·sigmoid(g) · λ·tanh(u/λ)."""
    return beta * math.tanh(g / beta) * sigmoid(g) * lam * math.tanh(u / lam)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [S, K], w [N, K] -> x @ w^T [S, N], unrounded."""
    S, N = x.shape[0], w.shape[0]
    out = np.zeros((S, N))
    for t in range(S):
        for n in range(N):
            out[t, n] = dot(x[t], w[n])
    return out


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [S, N] -> bf16(x·rsqrt(mean(x²)+eps)·w), one rounding."""
    S, N = x.shape
    out = np.zeros((S, N))
    for t in range(S):
        r = 1.0 / math.sqrt(math.fsum(x[t] * x[t]) / N + eps)
        for d in range(N):
            out[t, d] = x[t, d] * r * w[d]
    return bf16(out)


# ---------------------------------------------------------------- K1

def pending_delta(prefix: np.ndarray, delta: np.ndarray | None) -> np.ndarray:
    """[S, H]: pre = bf16(prefix + delta), or prefix."""
    return prefix.copy() if delta is None else bf16(prefix + delta)


def attnres(blocks: np.ndarray, pre: np.ndarray, nblocks: int, nw: np.ndarray, qk: np.ndarray,
            eps: float) -> np.ndarray:
    """blocks [S, NB, H], pre [S, H] -> mixed [S, H] (not rounded).

    Sources: bank rows 0..nblocks-1, then pre; softmax over logit_s = (v_s·c)·rsqrt(mean v_s² + eps).
    """
    S, _, H = blocks.shape
    c = nw * qk
    mixed = np.zeros((S, H))
    for t in range(S):
        srcs = [blocks[t, s] for s in range(nblocks)] + [pre[t]]
        logit = []
        for v in srcs:
            ms = math.fsum(v * v) / H
            logit.append(dot(v, c) / math.sqrt(ms + eps))
        top = max(logit)
        ex = [math.exp(z - top) for z in logit]
        z = math.fsum(ex)
        for d in range(H):
            mixed[t, d] = math.fsum(ex[s] / z * srcs[s][d] for s in range(len(srcs)))
    return mixed


def short_conv(proj: np.ndarray, conv_w: np.ndarray, conv_state: np.ndarray, st_idx: np.ndarray,
               num_acc: np.ndarray, L: int) -> tuple[np.ndarray, np.ndarray]:
    """proj [S, ≥C], conv_w [C, W], conv_state [CS, C, SL] -> (conv_out [S, C] bf16, new conv_state).

    Request r: window conv_state[sc, c, a-1 : a-1+W-1] (sc = st_idx[r, 0], null ≤ 0 read as 0),
    seq = window ++ proj rows of r; y_j = Σ_q w[c,q]·seq[j+q]; out = bf16(silu(y_j)).
    A real slot keeps seq[1:] in positions [0, W-2+L).
    """
    C, W = conv_w.shape
    S = proj.shape[0]
    R = S // L
    out = np.zeros((S, C))
    new = conv_state.copy()
    for r in range(R):
        a = int(num_acc[r])
        sc = int(st_idx[r, 0])
        rd = sc if sc > 0 else 0
        for c in range(C):
            seq = [conv_state[rd, c, a - 1 + i] for i in range(W - 1)] + [proj[r * L + j, c] for j in range(L)]
            for j in range(L):
                y = math.fsum(conv_w[c, q] * seq[j + q] for q in range(W))
                out[r * L + j, c] = silu(y)
            if sc > 0:
                for i in range(W - 2 + L):
                    new[sc, c, i] = seq[1 + i]
    return bf16(out), new


def gate_g1(proj: np.ndarray, w_fb: np.ndarray) -> np.ndarray:
    """g1 [S, P] = bf16(f_a @ w_fb^T), f_a = proj[:, 4P : 4P+RANK]."""
    P, RK = w_fb.shape
    fa = proj[:, 4 * P:4 * P + RK]
    return bf16(linear(fa, w_fb))


def gates(proj: np.ndarray, w_fb: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray, lower_bound: float,
          g1: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """-> gate [S, NH, HD] = lb·sigmoid(exp(A_log[h])·(g1 + dt_bias)), beta [S, NH] = sigmoid(b)."""
    P, RK = w_fb.shape
    nh = a_log.shape[0]
    hd = P // nh
    S = proj.shape[0]
    if g1 is None:
        g1 = gate_g1(proj, w_fb)
    gate = np.zeros((S, nh, hd))
    beta = np.zeros((S, nh))
    for t in range(S):
        for h in range(nh):
            A = math.exp(a_log[h])
            for i in range(hd):
                gate[t, h, i] = lower_bound * sigmoid(A * (g1[t, h * hd + i] + dt_bias[h * hd + i]))
            beta[t, h] = sigmoid(proj[t, 4 * P + RK + h])
    return gate, beta


def kda(conv_out: np.ndarray, gate: np.ndarray, beta: np.ndarray, rstate: np.ndarray, st_idx: np.ndarray,
        num_acc: np.ndarray, L: int) -> tuple[np.ndarray, np.ndarray, list]:
    """conv_out [S, 3P] (q|k|v), gate [S, NH, HD], beta [S, NH], rstate [RS, NH, HD(v), HD(k)]
    -> (o [S, NH, HD] bf16, new rstate, writes: list of (slot, r, j)).

    Start slot s0 = st_idx[r, a-1] (≤ 0: padding, o = 0, nothing written). Per token:
    S ← S·decay[k]; u = (v − S·k)·beta; S ← S + u⊗k; o = bf16(S·q); rstate[st_idx[r, j]] = S if > 0.
    """
    S, NH, HD = gate.shape
    P = NH * HD
    R = S // L
    o = np.zeros((S, NH, HD))
    new = rstate.copy()
    writes = []
    for r in range(R):
        a = int(num_acc[r])
        s0 = int(st_idx[r, a - 1])
        if s0 <= 0:
            continue
        for h in range(NH):
            St = [[float(rstate[s0, h, vi, ki]) for ki in range(HD)] for vi in range(HD)]
            for j in range(L):
                t = r * L + j
                q = [conv_out[t, h * HD + i] for i in range(HD)]
                k = [conv_out[t, P + h * HD + i] for i in range(HD)]
                v = [conv_out[t, 2 * P + h * HD + i] for i in range(HD)]
                qs = 1.0 / math.sqrt(math.fsum(z * z for z in q) + L2_EPS) / math.sqrt(HD)
                ks = 1.0 / math.sqrt(math.fsum(z * z for z in k) + L2_EPS)
                qn = [z * qs for z in q]
                kn = [z * ks for z in k]
                dec = [math.exp(gate[t, h, i]) for i in range(HD)]
                for vi in range(HD):
                    for ki in range(HD):
                        St[vi][ki] *= dec[ki]
                u = [(v[vi] - math.fsum(St[vi][ki] * kn[ki] for ki in range(HD))) * beta[t, h]
                     for vi in range(HD)]
                for vi in range(HD):
                    for ki in range(HD):
                        St[vi][ki] += u[vi] * kn[ki]
                for vi in range(HD):
                    o[t, h, vi] = math.fsum(St[vi][ki] * qn[ki] for ki in range(HD))
                slot = int(st_idx[r, j])
                if slot > 0:
                    new[slot, h] = np.array(St)
                    if h == 0:
                        writes.append((slot, r, j))
    return bf16(o), new, writes


def gated_norm(o: np.ndarray, g2: np.ndarray, on_w: np.ndarray, eps: float) -> np.ndarray:
    """o [S, NH, HD] bf16 values, g2 [S, P] -> core [S, P] =
    bf16(o·rsqrt(mean_v o² + eps)·on_w[v]·sigmoid(g2))."""
    S, NH, HD = o.shape
    core = np.zeros((S, NH * HD))
    for t in range(S):
        for h in range(NH):
            r = 1.0 / math.sqrt(math.fsum(o[t, h] * o[t, h]) / HD + eps)
            for v in range(HD):
                core[t, h * HD + v] = o[t, h, v] * r * on_w[v] * sigmoid(g2[t, h * HD + v])
    return bf16(core)


def k1(key, a: dict) -> dict:
    """End-to-end K1 on float64 copies of the launch kwargs `a` (torch tensors, not modified).

    Returns the taps and the post-launch values of every in/out tensor.
    """
    L = key.qlen
    g = {k: (f64(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in a.items()}
    st_idx, num_acc = a["st_idx"].numpy(), a["num_acc"].numpy()
    P = g["w_fb"].shape[0]
    pre = pending_delta(g["prefix"], g["delta"])
    blocks = g["blocks"].copy()
    if key.write_idx >= 0:
        blocks[:, key.write_idx] = pre
    mixed = attnres(blocks, pre, key.nblocks, g["ares_nw"], g["ares_qk"], key.eps)
    x = rmsnorm(mixed, g["in_nw"], key.out_eps)
    proj = bf16(linear(x, g["w_in"]))
    conv_out, conv_state = short_conv(proj, g["conv_w"], g["conv_state"], st_idx, num_acc, L)
    gate, beta = gates(proj, g["w_fb"], g["a_log"], g["dt_bias"], key.lower_bound)
    o, rstate, _ = kda(conv_out, gate, beta, g["rstate"], st_idx, num_acc, L)
    core = gated_norm(o, proj[:, 3 * P:4 * P], g["on_w"], key.onorm_eps)
    return dict(x=x, proj=proj, conv_out=conv_out, gate=gate, beta=beta, o=o, prefix=pre, blocks=blocks,
                conv_state=conv_state, rstate=rstate, core_out=core)


# ---------------------------------------------------------------- quant formats (§7)

def e2m1_value(code: int) -> float:
    """4-bit E2M1: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa."""
    s = -1.0 if code & 8 else 1.0
    e = (code >> 1) & 3
    m = code & 1
    mag = m * 0.5 if e == 0 else (1.0 + m / 2.0) * 2.0 ** (e - 1)
    return s * mag


def e2m1_code(x: float) -> int:
    """Nearest E2M1 (ties to the even code), saturating at ±6."""
    mags = [e2m1_value(c) for c in range(8)]
    ax = abs(x)
    if ax >= mags[7]:
        return 7 | (8 if x < 0 else 0)
    best = 0
    for c in range(1, 8):
        d, db = abs(ax - mags[c]), abs(ax - mags[best])
        if d < db or (d == db and c % 2 == 0):
            best = c
    return best | (8 if x < 0 else 0)


def e8m0_value(s: int) -> float:
    return math.nan if s == 0xFF else math.ldexp(1.0, s - 127)


def mx_scale(amax: float) -> int:
    """E8M0 code: power-of-two ceiling of fp32(amax·fp32(1/6)), clamped to ≤ 254; amax = 0 -> 0."""
    v = float(np.float32(amax) * np.float32(1.0 / 6.0))
    if v == 0.0:
        return 0
    if v < 2.0 ** -126:  # fp32 subnormal: exponent field 0, mantissa non-zero
        return 1
    m, e = math.frexp(v)  # v = m·2^e: exponent field e-1+127, mantissa zero iff m == 0.5
    return min(e + 126 + (0 if m == 0.5 else 1), 254)


def mx_quant_vec(x) -> tuple[list[int], list[int]]:
    """[K] values (K % 32 == 0) -> (E2M1 codes [K], E8M0 scales [K/32])."""
    x = [float(z) for z in x]
    codes, scales = [], []
    for b in range(0, len(x), QBLOCK):
        blk = x[b:b + QBLOCK]
        s = mx_scale(max(abs(z) for z in blk))
        scales.append(s)
        codes += [e2m1_code(z / math.ldexp(1.0, s - 127)) for z in blk]
    return codes, scales


def mx_fake_quant_vec(x) -> np.ndarray:
    codes, scales = mx_quant_vec(x)
    return np.array([e2m1_value(c) * e8m0_value(scales[i // QBLOCK]) for i, c in enumerate(codes)])


def nibble(byte_row: np.ndarray, k: int) -> int:
    """Code k of a packed row (low nibble = even k)."""
    b = int(byte_row[k // 2])
    return b & 0xF if k % 2 == 0 else b >> 4


def dequant_row(w, ws, fmt: str) -> np.ndarray:
    """One logical weight row [K] of an expert matrix in any §7 format."""
    if fmt == "bf16":
        return f64(w)
    w = np.asarray(w.numpy() if isinstance(w, torch.Tensor) else w)
    K = 2 * w.shape[0]
    if fmt == "mxfp4":
        s = np.asarray(ws.numpy() if isinstance(ws, torch.Tensor) else ws)
        return np.array([e2m1_value(nibble(w, k)) * e8m0_value(int(s[k // QBLOCK])) for k in range(K)])
    if fmt == "int4":
        s = f64(ws)
        return np.array([(nibble(w, k) - 8) * s[k // QBLOCK] for k in range(K)])
    raise ValueError(fmt)


def dequant_matrix(w, ws, fmt: str) -> np.ndarray:
    """[N, ·] packed -> [N, K] values."""
    return np.stack([dequant_row(w[n], None if ws is None else ws[n], fmt) for n in range(w.shape[0])])


# ---------------------------------------------------------------- K2

def _beats(a: float, b: float) -> bool:
    """Strictly better key; NaN ranks below every number."""
    if math.isnan(a):
        return False
    if math.isnan(b):
        return True
    return a > b


def router(logits: np.ndarray, bias: np.ndarray, topk: int, force_ids=None) -> tuple[np.ndarray, np.ndarray]:
    """logits [S, E] -> ids [S, K] (key = σ+bias descending, ties to lower id), weights [S, K] = σ_k/Σσ
    (σ NaN counts as 0)."""
    S, E = logits.shape
    ids = np.zeros((S, topk), dtype=np.int64)
    wts = np.zeros((S, topk))
    for t in range(S):
        sig = [sigmoid(z) if not math.isnan(z) else math.nan for z in logits[t]]
        key = [sig[e] + bias[e] for e in range(E)]
        if force_ids is None:
            chosen: list[int] = []
            for _ in range(topk):
                best = None
                for e in range(E):  # ascending id, strict improvement: ties keep the lower id
                    if e in chosen:
                        continue
                    if best is None or _beats(key[e], key[best]):
                        best = e
                chosen.append(best)
        else:
            chosen = [int(e) for e in force_ids[t]]
        s = [0.0 if math.isnan(sig[e]) else sig[e] for e in chosen]
        tot = 0.0
        for z in s:
            tot += z
        ids[t] = chosen
        wts[t] = [z / tot for z in s]
    return ids, wts


def shared_expert(x: np.ndarray, w_sgu: np.ndarray, w_sd: np.ndarray, beta: float, lam: float) -> np.ndarray:
    """x [S, H] -> sh [S, H]: gu = bf16(x w_sgu^T); h = bf16(SiTU(g, u)); sh = bf16(h w_sd^T)."""
    SI = w_sd.shape[1]
    gu = bf16(linear(x, w_sgu))
    S = x.shape[0]
    h = np.zeros((S, SI))
    for t in range(S):
        for i in range(SI):
            h[t, i] = situ(gu[t, i], gu[t, SI + i], beta, lam)
    return bf16(linear(bf16(h), w_sd))


class Experts:
    """Lazily dequantized expert matrices of one rank: w13[e] [2RI, LAT], w2[e] [LAT, RI]."""

    def __init__(self, w13, w13s, w2, w2s, fmt):
        self.a = (w13, w13s, w2, w2s)
        self.fmt = fmt
        self.cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __getitem__(self, e: int):
        if e not in self.cache:
            w13, w13s, w2, w2s = self.a
            self.cache[e] = (dequant_matrix(w13[e], None if w13s is None else w13s[e], self.fmt),
                             dequant_matrix(w2[e], None if w2s is None else w2s[e], self.fmt))
        return self.cache[e]


def routed(lat: np.ndarray, ids: np.ndarray, wts: np.ndarray, ex: Experts, beta: float, lam: float) -> np.ndarray:
    """lat [S, LAT] bf16 values, ids/wts [S, K] -> this rank's y [S, LAT].

    Per pick: g,u = a @ w13[e]^T; v = SiTU(g, u); acc = v @ w2[e]^T; contrib = bf16(acc·w);
    y = bf16(y + contrib) in pick order from 0. mxfp4: a and v MXFP4 per 32 (v never bf16);
    int4/bf16: a = lat, v rounded to bf16.
    """
    S, LAT = lat.shape
    K = ids.shape[1]
    y = np.zeros((S, LAT))
    for t in range(S):
        a = mx_fake_quant_vec(lat[t]) if ex.fmt == "mxfp4" else lat[t]
        for k in range(K):
            w13, w2 = ex[int(ids[t, k])]
            RI = w13.shape[0] // 2
            v = [situ(dot(a, w13[i]), dot(a, w13[RI + i]), beta, lam) for i in range(RI)]
            v = mx_fake_quant_vec(v) if ex.fmt == "mxfp4" else bf16(np.array(v))
            for d in range(LAT):
                contrib = float(bf16(dot(v, w2[d]) * wts[t, k]))
                y[t, d] = float(bf16(y[t, d] + contrib))
    return y


def up_fin(sh: np.ndarray, ln: np.ndarray, w_up: np.ndarray, rank: int) -> np.ndarray:
    """fin = sh, except columns [rank·UP_N, (rank+1)·UP_N): bf16(sh + LN @ w_up^T)."""
    S, H = sh.shape
    n = w_up.shape[0]
    fin = sh.copy()
    for t in range(S):
        for c in range(rank * n, (rank + 1) * n):
            fin[t, c] = sh[t, c] + dot(ln[t], w_up[c - rank * n])
    fin[:, rank * n:(rank + 1) * n] = bf16(fin[:, rank * n:(rank + 1) * n])
    return fin


def reduce_bf16(parts: list[np.ndarray]) -> np.ndarray:
    """bf16(Σ_r parts[r]) elementwise (correctly rounded sum, then one bf16 rounding)."""
    out = np.zeros(parts[0].shape)
    for i in np.ndindex(out.shape):
        out[i] = math.fsum(p[i] for p in parts)
    return bf16(out)


def k2_world(key, ranks: list[dict], force_ids=None) -> list[dict]:
    """End-to-end K2 over every rank's kwargs (torch tensors, not modified) -> per-rank taps + outputs."""
    W = len(ranks)
    g = [{k: (f64(v) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in a.items()}
         for a in ranks]
    b, lam = key.situ_beta, key.situ_linear_beta
    delta = reduce_bf16([bf16(linear(g[r]["core"], g[r]["w_o"])) for r in range(W)])
    res = []
    for r in range(W):
        a = g[r]
        prefix = delta.copy() if key.reset else bf16(a["prefix"] + delta)
        x = rmsnorm(attnres(a["blocks"], prefix, key.nblocks, a["ares_nw"], a["ares_qk"], key.eps),
                    a["in_nw"], key.out_eps)
        logits = linear(x, a["w_gate"])
        ids, wts = router(logits, a["bias"], key.topk, force_ids)
        lat = bf16(linear(x, a["w_ld"]))
        sh = shared_expert(x, a["w_sgu"], a["w_sd"], b, lam)
        ex = Experts(ranks[r]["w13"], ranks[r]["w13s"], ranks[r]["w2"], ranks[r]["w2s"], key.experts)
        y = routed(lat, ids, wts, ex, b, lam)
        res.append(dict(delta=delta, prefix=prefix, x=x, logits=logits, topk_ids=ids, topk_w=wts, lat=lat,
                        sh=sh, y=y))
    ln = rmsnorm(reduce_bf16([res[r]["y"] for r in range(W)]), g[0]["ln_w"], key.ln_eps)
    for r in range(W):
        res[r]["ln"] = ln
        res[r]["fin"] = up_fin(res[r]["sh"], ln, g[r]["w_up"], r)
    out = reduce_bf16([res[r]["fin"] for r in range(W)])
    for r in range(W):
        res[r]["out"] = out
    return res


# ---------------------------------------------------------------- comparisons

TINY_ABS = 2.0 ** -100


def bf16_ord(x: np.ndarray) -> np.ndarray:
    """Ordinal of bf16-representable float64 values: adjacent bf16 numbers differ by 1 (±0 -> 0)."""
    bits = (np.asarray(x, np.float64).astype(np.float32).view(np.uint32) >> 16).astype(np.int64)
    return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)


def _where(shape, flat: int) -> tuple:
    return tuple(int(i) for i in np.unravel_index(flat, shape))


def assert_bf16(name: str, got: torch.Tensor, want, max_ulp: int = 1, max_frac: float = 0.02) -> dict:
    """`got` (bf16) vs the loop value `want` rounded to bf16: at most `max_ulp` bf16 ulps apart, and
    at most `max_frac` of the elements not bit-equal (near-ties of fp32 vs exact accumulation)."""
    assert got.dtype == torch.bfloat16, f"{name}: dtype {got.dtype}, expected bfloat16"
    want = bf16(np.asarray(want, np.float64))
    g = f64(got)
    assert g.shape == want.shape, f"{name}: shape {g.shape}, loop {want.shape}"
    assert np.isfinite(g).all(), f"{name}: {int((~np.isfinite(g)).sum())} non-finite values"
    d = np.abs(bf16_ord(g) - bf16_ord(want))
    # below 2^-100 an fp32 formula may underflow (silu(y) for y < -88 is -0 in torch) while the
    # float64 loop keeps ~1e-37: not a bf16 difference
    d[(np.abs(g) < TINY_ABS) & (np.abs(want) < TINY_ABS)] = 0
    worst = int(d.argmax())
    frac = float((d > 0).mean())
    info = dict(max_ulp=int(d.max()), frac=frac, n=d.size)
    msg = (f"{name}: max {int(d.max())} ulp at {_where(d.shape, worst)} (got {g.flat[worst]!r}, "
           f"loop {want.flat[worst]!r}); {int((d > 0).sum())}/{d.size} not bit-equal")
    assert d.max() <= max_ulp and frac <= max_frac, msg
    return info


def assert_close(name: str, got: torch.Tensor, want, rtol: float, atol: float = 0.0) -> None:
    """Elementwise |got − want| ≤ atol + rtol·|want| (for fp32 outputs vs a float64 loop)."""
    g = f64(got)
    want = np.asarray(want, np.float64)
    assert g.shape == want.shape, f"{name}: shape {g.shape}, loop {want.shape}"
    err = np.abs(g - want)
    lim = atol + rtol * np.abs(want)
    bad = ~(err <= lim)
    if bad.any():
        i = int(np.argmax(np.where(bad, err / np.maximum(lim, 1e-300), 0)))
        raise AssertionError(f"{name}: {int(bad.sum())}/{bad.size} outside atol={atol} rtol={rtol}; worst at "
                             f"{_where(bad.shape, i)}: got {g.flat[i]!r}, loop {want.flat[i]!r}")


def assert_bits(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical tensors (same dtype, shape and bytes; NaN payloads included)."""
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{name}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    a, b = got.contiguous(), want.contiguous()
    if a.element_size() in (2, 4, 8) and a.is_floating_point():
        iv = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(iv), b.view(iv)
    ne = a != b
    if bool(ne.any()):
        i = int(torch.nonzero(ne.flatten())[0])
        raise AssertionError(f"{name}: {int(ne.sum())}/{ne.numel()} elements differ; first at "
                             f"{_where(tuple(got.shape), i)}: {got.flatten()[i].item()!r} vs "
                             f"{want.flatten()[i].item()!r}")


def rel_l2(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = f64(a), f64(b)
    nb = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / (nb if nb > 0 else 1.0)
