"""K1 (kda_pre) of the reference against the independent loops of tests/loops.py, stage by
stage (each stage fed the reference's previous tap) and end to end, plus the speculative
state rules of DESIGN §5 K1.5/K1.7 and the AttnRes carry bookkeeping of K1.1."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import loops as lp
import ref
from conftest import TINY, clone

pytestmark = pytest.mark.cpu

BF16 = torch.bfloat16
# layer (tiny: block_size 2, MLA at 1-based 4 and 6), pending delta, padding cadence
CASES = [
    pytest.param(1, True, 3, id="plain-delta-pad"),
    pytest.param(2, True, 0, id="blockwrite-delta"),
    pytest.param(0, False, 2, id="layer0-nodelta-pad"),
    pytest.param(4, False, 0, id="blockwrite-nodelta"),
]


def run(key, kw, **extra):
    taps: dict = {}
    ref.kda_pre(key, **kw, taps=taps, **extra)
    return taps


def live_requests(kw):
    st, na = kw["st_idx"], kw["num_acc"]
    return [r for r in range(st.shape[0]) if int(st[r, int(na[r]) - 1]) > 0]


def touched_rslots(kw, L):
    st = kw["st_idx"]
    return {int(st[r, j]) for r in live_requests(kw) for j in range(L) if int(st[r, j]) > 0}


def touched_cslots(kw):
    return {int(s) for s in kw["st_idx"][:, 0].tolist() if s > 0}


@pytest.mark.parametrize("layer,with_delta,pad", CASES)
def test_stages_isolated(k1_case, layer, with_delta, pad):
    key, kw = k1_case(TINY, layer=layer, with_delta=with_delta, pad_every=pad)
    before = clone(kw)
    t = run(key, kw)
    L, P = key.qlen, TINY.p
    st, na = before["st_idx"].numpy(), before["num_acc"].numpy()

    # 1. pending delta + block write: bit-exact bookkeeping
    pre = lp.pending_delta(lp.f64(before["prefix"]), None if before["delta"] is None else lp.f64(before["delta"]))
    lp.assert_bits("prefix", kw["prefix"], torch.from_numpy(pre).to(BF16))
    want_blocks = before["blocks"].clone()
    if key.write_idx >= 0:
        want_blocks[:, key.write_idx] = kw["prefix"]
    lp.assert_bits("blocks", kw["blocks"], want_blocks)
    # 2-3. AttnRes + input norm from the written carry
    mixed = lp.attnres(lp.f64(kw["blocks"]), lp.f64(kw["prefix"]), key.nblocks, lp.f64(before["ares_nw"]),
                       lp.f64(before["ares_qk"]), key.eps)
    lp.assert_bf16("x", t["x"], lp.rmsnorm(mixed, lp.f64(before["in_nw"]), key.out_eps))
    # 4. in_proj from the x tap
    lp.assert_bf16("proj", t["proj"], lp.linear(lp.f64(t["x"]), lp.f64(before["w_in"])))
    proj = lp.f64(t["proj"])
    # 5. conv from the proj tap; the whole cache after the launch is bit-exact
    conv_out, conv_state = lp.short_conv(proj, lp.f64(before["conv_w"]), lp.f64(before["conv_state"]), st, na, L)
    lp.assert_bf16("conv_out", t["conv_out"], conv_out)
    lp.assert_bits("conv_state", kw["conv_state"], torch.from_numpy(conv_state).to(BF16))
    # 6. gates from the proj tap; g1 is a bf16 rounding point, so a near-tie may move it one ulp
    w_fb, a_log, dtb = lp.f64(before["w_fb"]), lp.f64(before["a_log"]), lp.f64(before["dt_bias"])
    g1 = lp.gate_g1(proj, w_fb)
    gate, beta = lp.gates(proj, w_fb, a_log, dtb, key.lower_bound, g1)
    ulp = np.ldexp(1.0, np.frexp(np.abs(g1))[1] - 8)
    alts = [gate] + [lp.gates(proj, w_fb, a_log, dtb, key.lower_bound, g1 + s * ulp)[0] for s in (-1, 1)]
    gt = lp.f64(t["gate"])
    assert t["gate"].dtype == torch.float32 and t["gate"].shape == gate.shape
    ok = np.zeros(gate.shape, bool)
    for alt in alts:
        ok |= np.abs(gt - alt) <= 2e-6 * np.abs(alt) + 1e-7
    assert ok.all(), f"gate: {int((~ok).sum())} elements off the loop (incl. g1 ± 1 ulp); worst " \
                     f"{np.abs(gt - gate).max()}"
    assert (np.abs(gt - gate) <= 2e-6 * np.abs(gate) + 1e-7).mean() >= 0.98
    lp.assert_close("beta", t["beta"], beta, rtol=1e-6, atol=1e-7)
    # 7. recurrence from the conv_out / gate / beta taps
    o, rstate, writes = lp.kda(lp.f64(t["conv_out"]), lp.f64(t["gate"]), lp.f64(t["beta"]),
                               lp.f64(before["rstate"]), st, na, L)
    lp.assert_bf16("o", t["o"], o)
    written = {s for s, _, _ in writes}
    assert written == touched_rslots(before, L)
    for s in range(before["rstate"].shape[0]):
        if s in written:
            lp.assert_close(f"rstate[{s}]", kw["rstate"][s], rstate[s], rtol=1e-5, atol=1e-6)
        else:
            lp.assert_bits(f"rstate[{s}] (untouched)", kw["rstate"][s], before["rstate"][s])
    # 8. gated norm from the o tap and proj's g2
    lp.assert_bf16("core_out", kw["core_out"], lp.gated_norm(lp.f64(t["o"]), proj[:, 3 * P:4 * P],
                                                            lp.f64(before["on_w"]), key.onorm_eps))
    for name in ("x", "proj", "conv_out", "o"):
        assert t[name].dtype == BF16, name


@pytest.mark.parametrize("layer,with_delta,pad", CASES[:2])
def test_end_to_end(k1_case, layer, with_delta, pad):
    key, kw = k1_case(TINY, layer=layer, with_delta=with_delta, pad_every=pad, sl_extra=2)
    before = clone(kw)
    t = run(key, kw)
    want = lp.k1(key, before)
    for name in ("x", "proj", "conv_out", "o"):
        lp.assert_bf16(name, t[name], want[name], max_ulp=1, max_frac=0.03)
    lp.assert_bf16("core_out", kw["core_out"], want["core_out"], max_ulp=2, max_frac=0.03)
    lp.assert_close("gate", t["gate"], want["gate"], rtol=1e-3, atol=1e-5)
    lp.assert_close("beta", t["beta"], want["beta"], rtol=1e-5, atol=1e-7)
    lp.assert_bits("prefix", kw["prefix"], torch.from_numpy(want["prefix"]).to(BF16))
    lp.assert_bits("blocks", kw["blocks"], torch.from_numpy(want["blocks"]).to(BF16))
    # the carried window holds in_proj values: bit-exact only given the same proj (isolated test)
    lp.assert_bf16("conv_state", kw["conv_state"], want["conv_state"], max_ulp=1, max_frac=0.01)
    lp.assert_close("rstate", kw["rstate"], want["rstate"], rtol=1e-3, atol=1e-5)
    assert not torch.isnan(kw["core_out"]).any(), "core_out: poisoned elements left unwritten"


# ---------------------------------------------------------------- speculative state rules

def test_read_slot_is_last_accepted(k1_case):
    """The recurrence starts from st_idx[r, num_acc[r]-1]; the request's other slots are not read."""
    key, kw = k1_case(TINY, R=4, L=3)
    kw["num_acc"] = torch.tensor([1, 2, 3, 2], dtype=torch.int32)
    base = clone(kw)
    t0 = run(key, clone(base))
    st, na = base["st_idx"], base["num_acc"]
    L = key.qlen
    # scramble every slot of every request except the one it reads
    other = clone(base)
    for r in range(4):
        for j in range(L):
            if j != int(na[r]) - 1:
                other["rstate"][int(st[r, j])] = 1234.5 + j
    t1 = run(key, other)
    lp.assert_bits("o (unread slots scrambled)", t1["o"], t0["o"])
    # change only the read slot of request 2: only its rows move
    mine = clone(base)
    mine["rstate"][int(st[2, int(na[2]) - 1])] *= -1.5
    t2 = run(key, mine)
    rows = slice(2 * L, 3 * L)
    lp.assert_bits("o (other requests)", torch.cat([t2["o"][:2 * L], t2["o"][3 * L:]]),
                   torch.cat([t0["o"][:2 * L], t0["o"][3 * L:]]))
    assert not torch.equal(t2["o"][rows], t0["o"][rows]), "o of request 2 ignored its read slot"


def test_conv_window_read(k1_case):
    """conv reads positions [a-1, a-1+W-1) of slot st_idx[r, 0] and nothing else."""
    key, kw = k1_case(TINY, R=3, L=3, sl_extra=3)
    kw["num_acc"] = torch.tensor([1, 3, 2], dtype=torch.int32)
    base = clone(kw)
    t0 = run(key, clone(base))
    W, SL, L = TINY.conv, key.state_len, key.qlen
    outside = clone(base)
    for r in range(3):
        sc, a = int(base["st_idx"][r, 0]), int(base["num_acc"][r])
        for p in range(SL):
            if not a - 1 <= p < a - 1 + W - 1:
                outside["conv_state"][sc, :, p] = -77.0
    t1 = run(key, outside)
    lp.assert_bits("conv_out (positions outside the window changed)", t1["conv_out"], t0["conv_out"])
    inside = clone(base)
    sc, a = int(base["st_idx"][1, 0]), int(base["num_acc"][1])
    inside["conv_state"][sc, :, a - 1] += 1.0
    t2 = run(key, inside)
    assert not torch.equal(t2["conv_out"][L:2 * L], t0["conv_out"][L:2 * L])
    lp.assert_bits("conv_out (other requests)", t2["conv_out"][:L], t0["conv_out"][:L])


def test_conv_carry_and_untouched_tail(k1_case):
    """Positions [0, W-2+L) of a real conv slot become seq[1:]; later positions stay; then the
    next step's window for any acceptance a' ends at the last accepted token."""
    key, kw = k1_case(TINY, R=3, L=3, sl_extra=3)
    before = clone(kw)
    t = run(key, kw)
    W, L = TINY.conv, key.qlen
    keep = W - 2 + L
    proj = t["proj"]
    for r in range(3):
        sc, a = int(before["st_idx"][r, 0]), int(before["num_acc"][r])
        old = before["conv_state"][sc]
        seq = torch.cat([old[:, a - 1:a - 1 + W - 1], proj[r * L:(r + 1) * L, :3 * TINY.p].T], dim=1)
        lp.assert_bits(f"conv_state[{sc}][:, :W-2+L]", kw["conv_state"][sc, :, :keep], seq[:, 1:])
        lp.assert_bits(f"conv_state[{sc}][:, W-2+L:]", kw["conv_state"][sc, :, keep:], old[:, keep:])
        for a2 in range(1, L + 1):  # window ending at token a2-1 of this step
            win = kw["conv_state"][sc, :, a2 - 1:a2 - 1 + W - 1]
            lp.assert_bits(f"next window a'={a2}", win, seq[:, a2:a2 + W - 1])


def test_partial_null_slots_and_conv_slot(k1_case):
    """st_idx[r, j] ≤ 0 at j > 0 is not written; a null conv slot with a live start slot reads conv
    slot 0 and writes no conv state, while its recurrent slots are written."""
    key, kw = k1_case(TINY, R=3, L=3)
    st = kw["st_idx"]
    st[0] = torch.tensor([1, 0, 3], dtype=torch.int32)
    st[1] = torch.tensor([0, 5, 6], dtype=torch.int32)  # conv slot null, recurrent slots real
    st[2] = torch.tensor([7, -1, 9], dtype=torch.int32)
    kw["num_acc"] = torch.tensor([1, 2, 3], dtype=torch.int32)
    before = clone(kw)
    t = run(key, kw)
    L = key.qlen
    npst = before["st_idx"].numpy()
    conv_out, conv_state = lp.short_conv(lp.f64(t["proj"]), lp.f64(before["conv_w"]), lp.f64(before["conv_state"]),
                                         npst, before["num_acc"].numpy(), L)
    lp.assert_bf16("conv_out", t["conv_out"], conv_out)
    lp.assert_bits("conv_state", kw["conv_state"], torch.from_numpy(conv_state).to(BF16))
    o, rstate, writes = lp.kda(lp.f64(t["conv_out"]), lp.f64(t["gate"]), lp.f64(t["beta"]),
                               lp.f64(before["rstate"]), npst, before["num_acc"].numpy(), L)
    assert sorted(s for s, _, _ in writes) == [1, 3, 5, 6, 7, 9]
    lp.assert_bf16("o", t["o"], o)
    for s in range(kw["rstate"].shape[0]):
        if s in (1, 3, 5, 6, 7, 9):
            lp.assert_close(f"rstate[{s}]", kw["rstate"][s], rstate[s], rtol=1e-5, atol=1e-6)
        else:
            lp.assert_bits(f"rstate[{s}]", kw["rstate"][s], before["rstate"][s])
    assert touched_cslots(before) == {1, 7}
    for s in (0, 5, 6, 9):
        lp.assert_bits(f"conv_state[{s}] (not a real conv slot)", kw["conv_state"][s], before["conv_state"][s])


def test_padding_requests(k1_case):
    """Null start slots (0 and -1): o and core are exactly 0, no state anywhere is written."""
    key, kw = k1_case(TINY, R=4, L=3, pad_every=2)
    st = kw["st_idx"]
    assert int(st[1, 0]) == 0 and int(st[3, 0]) == -1, "synth: expected padding rows 1 (slot 0) and 3 (-1)"
    # slot 0 is the null slot: poison it with large finite sentinels (conv of a padding request reads it)
    kw["rstate"][0] = 1234.5
    kw["conv_state"][0] = 96.0
    before = clone(kw)
    t = run(key, kw)
    L = key.qlen
    # their conv still runs, on the window of slot 0 (a null slot reads as slot 0)
    conv_out, _ = lp.short_conv(lp.f64(t["proj"]), lp.f64(before["conv_w"]), lp.f64(before["conv_state"]),
                                before["st_idx"].numpy(), before["num_acc"].numpy(), L)
    lp.assert_bf16("conv_out", t["conv_out"], conv_out)
    for r in (1, 3):
        rows = slice(r * L, (r + 1) * L)
        assert bool((t["o"][rows] == 0).all()), f"o of padding request {r} is not 0"
        assert bool((kw["core_out"][rows] == 0).all()), f"core_out of padding request {r} is not 0"
    lp.assert_bits("rstate slot 0", kw["rstate"][0], before["rstate"][0])
    lp.assert_bits("conv_state slot 0", kw["conv_state"][0], before["conv_state"][0])
    spare = range(1 + 4 * L, kw["rstate"].shape[0])
    for r in (1, 3):  # the slots synth would have given these requests are not referenced: untouched too
        for s in list(range(1 + r * L, 1 + (r + 1) * L)) + list(spare):
            lp.assert_bits(f"rstate[{s}]", kw["rstate"][s], before["rstate"][s])
            lp.assert_bits(f"conv_state[{s}]", kw["conv_state"][s], before["conv_state"][s])


def test_all_padding_writes_nothing(k1_case):
    key, kw = k1_case(TINY, R=2, L=3, pad_every=1)
    before = clone(kw)
    t = run(key, kw)
    assert bool((kw["core_out"] == 0).all()) and bool((t["o"] == 0).all())
    lp.assert_bits("rstate", kw["rstate"], before["rstate"])
    lp.assert_bits("conv_state", kw["conv_state"], before["conv_state"])


def test_untouched_slots_bit_identical(k1_case):
    """Poison every slot no request references with large finite sentinels: bit-identical after."""
    key, kw = k1_case(TINY, R=3, L=3, spare=5, pad_every=3)
    L = key.qlen
    rs, cs = touched_rslots(kw, L), touched_cslots(kw)
    for s in range(kw["rstate"].shape[0]):
        if s not in rs:
            kw["rstate"][s] = 1234.5 + s
        if s not in cs:
            kw["conv_state"][s] = -1232.0 + 8 * s
    before = clone(kw)
    run(key, kw)
    for s in range(kw["rstate"].shape[0]):
        if s not in rs:
            lp.assert_bits(f"rstate[{s}]", kw["rstate"][s], before["rstate"][s])
        else:
            assert not torch.equal(kw["rstate"][s], before["rstate"][s]), f"rstate[{s}] should be written"
        if s not in cs:
            lp.assert_bits(f"conv_state[{s}]", kw["conv_state"][s], before["conv_state"][s])


def test_strided_caches(k1_case):
    """conv_state as a transposed [slots, SL, C] buffer and rstate with strided slots give the same
    bits as contiguous caches, and write through to the buffers; interleaved slots stay."""
    key, kw = k1_case(TINY, R=3, L=3, sl_extra=1)
    base = clone(kw)
    t0 = run(key, kw)
    other = clone(base)
    buf = base["conv_state"].transpose(1, 2).contiguous()  # [slots, SL, C]
    other["conv_state"] = buf.transpose(1, 2)
    big = torch.full((2 * base["rstate"].shape[0],) + tuple(base["rstate"].shape[1:]), 1234.5)
    big[::2] = base["rstate"]
    other["rstate"] = big[::2]
    assert not other["conv_state"].is_contiguous() and not other["rstate"].is_contiguous()
    t1 = run(key, other)
    for name in t0:
        lp.assert_bits(f"tap {name}", t1[name], t0[name])
    lp.assert_bits("core_out", other["core_out"], kw["core_out"])
    lp.assert_bits("conv_state via buffer", buf.transpose(1, 2), kw["conv_state"])
    lp.assert_bits("rstate via buffer", big[::2], kw["rstate"])
    assert bool((big[1::2] == 1234.5).all()), "rstate: interleaved (foreign) slots were written"


def test_wide_st_idx(k1_case):
    """st_idx wider than L: columns ≥ L are ignored (their slots neither read nor written)."""
    key, kw = k1_case(TINY, R=3, L=3, spare=4)
    base = clone(kw)
    t0 = run(key, kw)
    other = clone(base)
    extra = torch.tensor([[10, 11], [12, 10], [11, 12]], dtype=torch.int32)
    other["st_idx"] = torch.cat([base["st_idx"], extra], dim=1)
    t1 = run(key, other)
    for name in t0:
        lp.assert_bits(f"tap {name}", t1[name], t0[name])
    lp.assert_bits("rstate", other["rstate"], kw["rstate"])
    lp.assert_bits("conv_state", other["conv_state"], kw["conv_state"])


# ---------------------------------------------------------------- AttnRes carry

@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "nodelta"])
def test_block_write_and_prefix(k1_case, with_delta):
    """Layer 4 (tiny) writes blocks[:, 2] = pre; no other row changes; prefix changes only with a delta."""
    key, kw = k1_case(TINY, layer=4, with_delta=with_delta)
    assert key.write_idx == 2 and key.nblocks == 2
    before = clone(kw)
    run(key, kw)
    if with_delta:
        pre = torch.from_numpy(lp.pending_delta(lp.f64(before["prefix"]), lp.f64(before["delta"]))).to(BF16)
        assert not torch.equal(pre, before["prefix"])
    else:
        pre = before["prefix"]
    lp.assert_bits("prefix", kw["prefix"], pre)
    lp.assert_bits("blocks[:, 2]", kw["blocks"][:, 2], pre)
    lp.assert_bits("blocks[:, :2]", kw["blocks"][:, :2], before["blocks"][:, :2])


def test_no_block_write_leaves_bank(k1_case):
    key, kw = k1_case(TINY, layer=1)
    assert key.write_idx == -1
    before = clone(kw)
    run(key, kw)
    lp.assert_bits("blocks", kw["blocks"], before["blocks"])


def test_nblocks_sources(k1_case):
    """AttnRes reads bank rows 0..nblocks-1 and the prefix: rows ≥ nblocks do not matter."""
    key, kw = k1_case(TINY, layer=1)  # nblocks 1, no block write
    assert key.nblocks == 1
    base = clone(kw)
    t0 = run(key, kw)
    other = clone(base)
    other["blocks"][:, 1:] = -3.0
    t1 = run(key, other)
    lp.assert_bits("x (rows >= nblocks changed)", t1["x"], t0["x"])
    used = clone(base)
    used["blocks"][:, 0] *= 0.5
    t2 = run(key, used)
    assert not torch.equal(t2["x"], t0["x"]), "x ignores bank row 0"


def test_layer0_mixes_prefix_only(k1_case):
    """nblocks = 0: the only AttnRes source is the prefix (softmax weight 1)."""
    key, kw = k1_case(TINY, layer=0, with_delta=False)
    assert key.nblocks == 0
    before = clone(kw)
    t = run(key, kw)
    lp.assert_bf16("x", t["x"], lp.rmsnorm(lp.f64(before["prefix"]), lp.f64(before["in_nw"]), key.out_eps))


def test_runtime_extras_ignored(k1_case):
    key, kw = k1_case(TINY)
    base = clone(kw)
    run(key, kw)
    other = clone(base)
    t = {}
    ref.kda_pre(key, **other, taps=t, scratch=torch.empty(16), epoch=3, stream=None)
    lp.assert_bits("core_out", other["core_out"], kw["core_out"])


def test_dims_come_from_shapes(seed):
    """A config unlike any preset (odd head count, conv width 3, L = 2): every stage still
    matches the loops, so nothing about `tiny` is baked into the stages."""
    import dataclasses

    from conftest import make_k1

    cfg = dataclasses.replace(TINY, name="odd", hidden=96, nh=3, hd=8, rank=8, conv=3, layers=5, block_size=3,
                              mla_layers=())
    key, kw = make_k1(cfg, seed, layer=3, R=4, L=2, pad_every=3, sl_extra=1)
    assert key.write_idx == 1 and key.nblocks == 1 and kw["w_in"].shape == (112, 96)
    before = clone(kw)
    t = run(key, kw)
    want = lp.k1(key, before)
    for name in ("x", "proj", "conv_out", "o"):
        lp.assert_bf16(name, t[name], want[name], max_frac=0.03)
    lp.assert_bf16("core_out", kw["core_out"], want["core_out"], max_ulp=2, max_frac=0.03)
    lp.assert_close("gate", t["gate"], want["gate"], rtol=1e-3, atol=1e-5)
    lp.assert_bits("blocks", kw["blocks"], torch.from_numpy(want["blocks"]).to(BF16))
    lp.assert_close("rstate", kw["rstate"], want["rstate"], rtol=1e-3, atol=1e-5)
