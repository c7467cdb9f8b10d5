"""Strict launch validation: a clear ArgError naming the argument, raised before anything is
written (wrong shape or dtype, num_acc outside 1..L, slot outside the cache, st_idx narrower
than L, state_len too small for the window, NaN/Inf in an input, inconsistent build key)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import loops as lp
import ref
from conftest import TINY, clone
from ref.abi import ArgError
from ref.comm import SimWorld

pytestmark = pytest.mark.cpu

NAN, INF = float("nan"), float("inf")


def _set(name, fn):
    def mut(key, kw):
        kw[name] = fn(kw[name])
        return key
    return mut


def _key(**changes):
    def mut(key, kw):
        return dataclasses.replace(key, **changes)
    return mut


def _poison(name, value, idx=(0,)):
    def mut(key, kw):
        t = kw[name].clone()
        t.view(-1)[idx[0]] = value
        kw[name] = t
        return key
    return mut


def _small_state(key, kw):
    """state_len = W-3+L: one position short of the window at num_acc = L."""
    kw["conv_state"] = kw["conv_state"][:, :, :-1].contiguous()
    return dataclasses.replace(key, state_len=key.state_len - 1)


def _few_conv_slots(key, kw):
    kw["conv_state"] = kw["conv_state"][:4].contiguous()  # request 1's conv slot is 4
    return key


K1_BAD = [
    ("w_in-hidden", _set("w_in", lambda t: t[:, :-1].contiguous()), "w_in"),
    ("blocks-hidden", _set("blocks", lambda t: t[:, :, :-1].contiguous()), "blocks"),
    ("core_out-shape", _set("core_out", lambda t: torch.zeros(t.shape[0], t.shape[1] + 1, dtype=t.dtype)), "core_out"),
    ("conv_state-channels", _set("conv_state", lambda t: t[:, :-1].contiguous()), "conv_state"),
    ("on_w-rank", _set("on_w", lambda t: t[None]), "on_w"),
    ("prefix-fp32", _set("prefix", lambda t: t.float()), "prefix"),
    ("w_in-fp16", _set("w_in", lambda t: t.half()), "w_in"),
    ("rstate-bf16", _set("rstate", lambda t: t.to(torch.bfloat16)), "rstate"),
    ("a_log-bf16", _set("a_log", lambda t: t.to(torch.bfloat16)), "a_log"),
    ("st_idx-int64", _set("st_idx", lambda t: t.long()), "st_idx"),
    ("num_acc-int64", _set("num_acc", lambda t: t.long()), "num_acc"),
    ("num_acc-0", _set("num_acc", lambda t: torch.tensor([1, 0, 2], dtype=torch.int32)), "num_acc"),
    ("num_acc-L+1", _set("num_acc", lambda t: torch.tensor([1, 4, 2], dtype=torch.int32)), "num_acc"),
    ("num_acc-neg", _set("num_acc", lambda t: torch.tensor([-1, 1, 1], dtype=torch.int32)), "num_acc"),
    ("rslot-outside", _set("st_idx", lambda t: torch.where(t == 9, torch.full_like(t, 13), t)), "st_idx"),
    ("cslot-outside", _few_conv_slots, "st_idx"),
    ("st_idx-narrow", _set("st_idx", lambda t: t[:, :2].contiguous()), "st_idx"),
    ("state_len-small", _small_state, "conv_state"),
    ("key-state_len", _key(state_len=7), "key.state_len"),
    ("key-tokens", _key(tokens=12), "key.tokens"),
    ("key-delta", _key(delta=False), "delta"),
    ("key-nblocks", _key(nblocks=9), "key.nblocks"),
    ("key-write_idx", _key(write_idx=3), "key.write_idx"),
    ("nan-prefix", _poison("prefix", NAN, (5,)), "prefix"),
    ("nan-delta", _poison("delta", NAN), "delta"),
    ("inf-blocks", _poison("blocks", -INF, (300,)), "blocks"),
    ("inf-w_in", _poison("w_in", INF, (77,)), "w_in"),
    ("nan-conv_state", _poison("conv_state", NAN, (1000,)), "conv_state"),
    ("inf-rstate", _poison("rstate", INF, (4000,)), "rstate"),
    ("nan-dt_bias", _poison("dt_bias", NAN), "dt_bias"),
    ("nan-a_log", _poison("a_log", NAN), "a_log"),
]


@pytest.mark.parametrize("mutate,field", [pytest.param(m, f, id=i) for i, m, f in K1_BAD])
def test_k1_rejects(k1_case, mutate, field):
    key, kw = k1_case(TINY, R=3, L=3, spare=2)  # 12 slots, requests own slots 1..9
    key = mutate(key, kw)
    before = clone(kw)
    with pytest.raises(ArgError) as ei:
        ref.kda_pre(key, **kw)
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.field == field, f"named {err.field!r} ({err}), expected {field!r}"
    assert str(err).startswith(f"{field}: ") and len(str(err).splitlines()) == 1
    for n in ("prefix", "blocks", "conv_state", "rstate", "core_out"):  # nothing written
        if isinstance(before.get(n), torch.Tensor):
            nan = torch.isnan(before[n])
            assert torch.equal(torch.isnan(kw[n]), nan), n
            lp.assert_bits(f"{n} after a rejected launch", kw[n][~nan], before[n][~nan])


def test_k1_accepts_poisoned_output(k1_case):
    """core_out is write-only: NaN poison there is not an input error."""
    key, kw = k1_case(TINY)
    assert torch.isnan(kw["core_out"]).all()
    ref.kda_pre(key, **kw)
    assert not torch.isnan(kw["core_out"]).any()


def test_k1_null_slots_below_minus_one_are_null(k1_case):
    """Any slot id ≤ 0 is the null slot (not an out-of-range error)."""
    key, kw = k1_case(TINY, R=3, L=3)
    kw["st_idx"][2] = torch.tensor([-7, -3, -2], dtype=torch.int32)
    before = clone(kw)
    t = {}
    ref.kda_pre(key, **kw, taps=t)
    assert bool((t["o"][6:] == 0).all())
    conv_out, conv_state = lp.short_conv(lp.f64(t["proj"]), lp.f64(before["conv_w"]), lp.f64(before["conv_state"]),
                                         before["st_idx"].numpy(), before["num_acc"].numpy(), key.qlen)
    lp.assert_bf16("conv_out (null slots read slot 0)", t["conv_out"], conv_out)
    lp.assert_bits("conv_state", kw["conv_state"], torch.from_numpy(conv_state).to(torch.bfloat16))


# ---------------------------------------------------------------- K2

def _k2_key(**changes):
    def mut(key, a, fmt):
        return dataclasses.replace(key, **changes)
    return mut


def _k2_set(name, fn):
    def mut(key, a, fmt):
        a[name] = fn(a[name])
        return key
    return mut


def _k2_poison(name, value, i=0):
    def mut(key, a, fmt):
        t = a[name].clone()
        t.view(-1)[i] = value
        a[name] = t
        return key
    return mut


K2_BAD = [
    ("core-fp32", "int4", _k2_set("core", lambda t: t.float()), "core"),
    ("w_o-P", "int4", _k2_set("w_o", lambda t: t[:, :-1].contiguous()), "w_o"),
    ("blocks-hidden", "int4", _k2_set("blocks", lambda t: t[:, :, :-1].contiguous()), "blocks"),
    ("bias-fp16", "int4", _k2_set("bias", lambda t: t.to(torch.float16)), "bias"),
    ("ln_w-LAT", "int4", _k2_set("ln_w", lambda t: t[:-1].contiguous()), "ln_w"),
    ("w_up-rows", "int4", _k2_set("w_up", lambda t: t[:-16].contiguous()), "w_up"),
    ("w13-bf16-for-mxfp4", "mxfp4", _k2_set("w13", lambda t: torch.zeros(t.shape, dtype=torch.bfloat16)), "w13"),
    ("w13s-missing", "mxfp4", _k2_set("w13s", lambda t: None), "w13s"),
    ("w2s-fp32-for-int4", "int4", _k2_set("w2s", lambda t: t.float()), "w2s"),
    ("w13s-for-bf16", "bf16", _k2_set("w13s", lambda t: torch.ones(8, 64, 2, dtype=torch.bfloat16)), "w13s"),
    ("w13-packed-K", "mxfp4", _k2_set("w13", lambda t: t[:, :, :-1].contiguous()), "w13"),
    ("w2s-K", "mxfp4", _k2_set("w2s", lambda t: torch.cat([t, t], dim=2)), "w2s"),
    ("key-experts", "bf16", _k2_key(experts="fp8"), "key.experts"),
    ("key-topk", "bf16", _k2_key(topk=17), "key.topk"),
    ("key-tokens", "bf16", _k2_key(tokens=7), "key.tokens"),
    ("key-nblocks", "bf16", _k2_key(nblocks=4), "key.nblocks"),
    ("nan-core", "int4", _k2_poison("core", NAN, 3), "core"),
    ("inf-bias", "int4", _k2_poison("bias", INF), "bias"),
    ("nan-prefix", "int4", _k2_poison("prefix", NAN, 9), "prefix"),
    ("nan-w13s-int4", "int4", _k2_poison("w13s", NAN, 11), "w13s"),
    ("inf-w_gate", "int4", _k2_poison("w_gate", -INF, 5), "w_gate"),
]


@pytest.mark.parametrize("fmt,mutate,field", [pytest.param(fm, m, f, id=i) for i, fm, m, f in K2_BAD])
def test_k2_rejects(k2_case, fmt, mutate, field):
    key, ranks = k2_case(TINY, layer=1, fmt=fmt)
    a = ranks[1]
    key = mutate(key, a, fmt)
    before = clone(a)
    with pytest.raises(ArgError) as ei:
        ref.k2_world(key, ranks)  # the failing rank must not leave the other waiting
    err = ei.value
    assert err.field == field, f"named {err.field!r} ({err}), expected {field!r}"
    assert str(err).startswith(f"{field}: ")
    nan = torch.isnan(before["prefix"])
    lp.assert_bits("prefix after a rejected launch", a["prefix"][~nan], before["prefix"][~nan])


def test_k2_rejects_comm_and_rank(k2_case):
    key, ranks = k2_case(TINY.with_world(1), layer=1)
    a = ranks[0]
    with pytest.raises(ArgError) as ei:
        ref.k2_launch(key, **a, rank=0, comm=None)
    assert ei.value.field == "comm"
    with pytest.raises(ArgError) as ei:
        ref.k2_launch(key, **a, rank=1, comm=SimWorld(1))
    assert ei.value.field == "rank"
    ref.k2_launch(key, **a, rank=0, comm=SimWorld(1), scratch=torch.empty(4), epoch=1)  # extras ignored
    assert not torch.isnan(a["out"]).any()


# --------------------------------------------------------------------------- oracle with stored-dtype weights

def _bits(a: dict, b: dict, names) -> None:
    for n in names:
        x, y = a[n], b[n]
        assert x.dtype == y.dtype == torch.float64 and torch.equal(x.view(torch.int64), y.view(torch.int64)), n


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_oracle_stored_dtype_weights_same_bits_as_upcast(k1_case, k2_case, fmt):
    """ref.abi.oracle_args leaves the read-only weights in their stored dtype (no 8.8 GB of
    float64 copies at k3-tp8); the reference upcasts them exactly at use, so the oracle's
    taps and outputs are bit-identical to those on ref.upcast'ed weights."""
    from ref import abi

    cfg = TINY
    key, kw = k1_case(cfg, layer=1)
    kept, up = abi.oracle_args(kw), ref.upcast(kw)
    assert kept["w_in"].dtype == torch.bfloat16 and kept["conv_w"].dtype == kw["conv_w"].dtype
    assert kept["w_in"].data_ptr() == kw["w_in"].data_ptr()  # not copied
    assert kept["prefix"].dtype == torch.float64 and kept["rstate"].dtype == torch.float64
    tk, tu = {}, {}
    ref.kda_pre(key, **kept, taps=tk, mode="oracle")
    ref.kda_pre(key, **up, taps=tu, mode="oracle")
    _bits(kept, up, ("prefix", "blocks", "conv_state", "rstate", "core_out"))
    _bits(tk, tu, [n for n in tu if isinstance(tu[n], torch.Tensor) and tu[n].is_floating_point()])
    key2, ranks = k2_case(cfg, fmt=fmt)
    kept = [dict(abi.oracle_args(a), taps={}) for a in ranks]
    up = [dict(ref.upcast(a), taps={}) for a in ranks]
    assert kept[0]["w_gate"].dtype == torch.bfloat16 and kept[0]["bias"].dtype == torch.float32
    ref.k2_world(key2, kept, mode="oracle")
    ref.k2_world(key2, up, mode="oracle")
    for a, b in zip(kept, up):
        _bits(a, b, ("prefix", "out"))
        _bits(a["taps"], b["taps"], [n for n in b["taps"] if isinstance(b["taps"][n], torch.Tensor)
                                     and b["taps"][n].is_floating_point()])
