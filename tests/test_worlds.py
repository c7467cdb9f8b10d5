"""Simulated worlds 1, 2, 4, 8 on one global model (conftest.WIDE, sliced by `with_world`):
K2 agrees with world 1 within bf16 rounding (routing forced to world 1's picks downstream,
natural picks equal except at near-ties), K1 per rank reassembles world 1's heads."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import loops as lp
import ref
from conftest import WIDE, clone, make_k1, make_k2
from ref import config as rcfg
from ref import synth

pytestmark = pytest.mark.cpu

BF16 = torch.bfloat16
WORLDS = (2, 4, 8)
TIE_EPS = 5e-3  # router keys closer than this may swap between worlds
REL = 1.2e-2  # world w vs world 1: a few bf16 roundings apart (measured ≈ 5e-3 on `out`)


def run(key, ranks, **extra):
    for a in ranks:
        a["taps"] = {}
    ref.k2_world(key, ranks, **extra)
    return [a.pop("taps") for a in ranks]


def topk_gap(logits: np.ndarray, bias: np.ndarray, k: int) -> np.ndarray:
    """[S]: key_k-th − key_(k+1)-th (σ + bias, float64)."""
    key = 1 / (1 + np.exp(-logits)) + bias
    srt = -np.sort(-key, axis=1)
    return srt[:, k - 1] - srt[:, k]


def test_world_configs_slice_one_model():
    for w in (1,) + WORLDS:
        c = WIDE.with_world(w)
        assert c.nh * w == WIDE.nh and c.ri * w == WIDE.ri and c.si * w == WIDE.si and c.up_n * w == WIDE.hidden
        assert c.ri % 32 == 0 and c.si % 32 == 0


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "int4"])
def test_k2_worlds_agree(seed, fmt):
    key1, r1 = make_k2(WIDE, seed, layer=3, fmt=fmt, S=8)
    t1 = run(key1, r1)[0]
    ids1 = t1["topk_ids"]
    gap = topk_gap(lp.f64(t1["logits"]), lp.f64(r1[0]["bias"]), key1.topk)
    for w in WORLDS:
        cfg = WIDE.with_world(w)
        key, rw = make_k2(cfg, seed, layer=3, fmt=fmt, S=8)
        assert key == key1 and len(rw) == w
        # the same global weights: rank slices concatenate to world 1's tensors
        lp.assert_bits("w_o slices", torch.cat([a["w_o"] for a in rw], dim=1), r1[0]["w_o"])
        lp.assert_bits("w_up slices", torch.cat([a["w_up"] for a in rw]), r1[0]["w_up"])
        natural = run(key, [clone(a) for a in rw])
        for s in range(key.tokens):
            same = set(natural[0]["topk_ids"][s].tolist()) == set(ids1[s].tolist())
            assert same or gap[s] < TIE_EPS, f"world {w} token {s}: picks {natural[0]['topk_ids'][s].tolist()} " \
                                             f"vs world 1 {ids1[s].tolist()}, key gap {gap[s]:.2e}"
        for a in rw:  # world 1's routing and MLP input: an upstream 1-ulp flip would cross E2M1
            a["force_ids"] = ids1  # code boundaries in lat and move the quantized tail by far more
            a["feed"] = {"x": t1["x"]}  # than the world split's own rounding
        tw = run(key, rw)
        for name in ("delta", "x", "logits", "lat", "ln"):
            e = lp.rel_l2(tw[0][name], t1[name])
            assert e < REL, f"world {w} {name}: rel L2 {e:.2e} vs world 1"
        for name in ("sh", "y"):  # unreduced partials: their rank sum is world 1's value
            e = lp.rel_l2(sum(t[name].double() for t in tw), t1[name])
            assert e < REL, f"world {w} Σ_r {name}: rel L2 {e:.2e} vs world 1"
        for nm in ("prefix", "out"):
            e = lp.rel_l2(rw[0][nm], r1[0][nm])
            assert e < REL, f"world {w} {nm}: rel L2 {e:.2e} vs world 1"
        for r in range(1, w):
            lp.assert_bits(f"world {w} out rank {r}", rw[r]["out"], rw[0]["out"])


def _k1_rank(cfg, world_kw, layer, seed, rank, key1):
    """Rank `rank` of a `cfg.world` split of the world-1 K1 kwargs `world_kw` (caches sliced by heads)."""
    P, Pg, nh = cfg.p, WIDE.p, cfg.nh
    kw = clone(world_kw)
    kw.update(synth.k1_weights(cfg, layer, rank, seed=seed))
    ch = torch.cat([torch.arange(i * Pg + rank * P, i * Pg + (rank + 1) * P) for i in range(3)])
    kw["conv_state"] = world_kw["conv_state"][:, ch].clone()
    kw["rstate"] = world_kw["rstate"][:, rank * nh:(rank + 1) * nh].clone()
    kw["core_out"] = torch.full((key1.tokens, P), float("nan"), dtype=BF16)
    return kw, ch


def test_k1_worlds_agree(seed):
    """K1 is rank-local: every rank's heads reproduce world 1's heads (same bits but where a
    differently shaped GEMM tips a near-tie)."""
    layer = 1
    key1, kw1 = make_k1(WIDE, seed, layer=layer, R=2, L=3, pad_every=0)
    base = clone(kw1)
    ref.kda_pre(key1, **kw1)
    for w in WORLDS:
        cfg = WIDE.with_world(w)
        lp.assert_bits("f_a rows replicated",
                       synth.k1_weights(cfg, layer, w - 1, seed=seed)["w_in"][4 * cfg.p:4 * cfg.p + cfg.rank],
                       base["w_in"][4 * WIDE.p:4 * WIDE.p + WIDE.rank])
        cores, convs, rst = [], torch.empty_like(kw1["conv_state"]), torch.empty_like(kw1["rstate"])
        for r in range(w):
            kw, ch = _k1_rank(cfg, base, layer, seed, r, key1)
            key = rcfg.k1_build(cfg, layer, key1.tokens, key1.qlen, key1.delta, key1.state_len)
            assert key == key1
            ref.kda_pre(key, **kw)
            cores.append(kw["core_out"])
            convs[:, ch] = kw["conv_state"]
            rst[:, r * cfg.nh:(r + 1) * cfg.nh] = kw["rstate"]
            if r:
                lp.assert_bits(f"world {w} prefix rank {r}", kw["prefix"], kw1["prefix"])
        lp.assert_bf16(f"world {w} core_out", torch.cat(cores, dim=1), lp.f64(kw1["core_out"]), max_frac=0.01)
        lp.assert_bf16(f"world {w} conv_state", convs, lp.f64(kw1["conv_state"]), max_frac=0.01)
        lp.assert_close(f"world {w} rstate", rst, lp.f64(kw1["rstate"]), rtol=1e-3, atol=1e-5)
