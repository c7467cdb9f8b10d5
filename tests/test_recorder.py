"""Recorder: record the reference through a multi-layer run, then replay the recording
(the reference re-run on the loaded inputs reproduces the recorded outputs bit for bit)."""
from __future__ import annotations

import hashlib

import pytest
import torch

import ref
from harness import capture as cap
from harness.recorder import Recorder
from harness.synth import synthesize
from ref import synth as rsynth
from ref.config import get_config, k1_build, k2_build

pytestmark = pytest.mark.cpu

TINY = get_config("tiny")
SEED = int(hashlib.sha256(__name__.encode()).hexdigest()[:6], 16)


def bits_equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(cap.same_bits(a, b).all())


def drive(tmp, rec=None, **kw):
    """The multi-layer driver: the generator's run over layers 0-3 (KDA, block-write and MLA
    layers, padding), with launches optionally wrapped by a Recorder."""
    args = dict(steps=2, num_spec=1, experts="int4", seed=SEED, requests=3, padding=1, progress=False, git=False)
    args.update(kw)
    hooks = {} if rec is None else dict(kda_pre=rec.kda_pre, k2_launch=rec.k2_launch)
    return synthesize("tiny", "0-3", out=tmp, **args, **hooks)


def test_record_and_replay(tmp_path):
    rec = Recorder(ref.kda_pre, ref.k2_launch, tmp_path / "rec", budget_bytes=1 << 30, cfg=TINY, quiet=True)
    gen_sets = drive(tmp_path / "gen", rec)
    summary = rec.close()
    assert summary["skipped"] == 0 and summary["unpaired_k1"] == 0 and summary["warnings"] == []
    assert not list((tmp_path / "rec").glob("**/journal.jsonl"))  # in-process sets: no per-rank journal
    rec_sets = cap.discover(tmp_path / "rec")
    assert [p.name for p in rec_sets] == [p.name for p in gen_sets]
    for rp, gp in zip(rec_sets, gen_sets):
        rs, gs = cap.load_set(rp), cap.load_set(gp)
        assert (rs.kind, rs.k1_key, rs.k2_key, rs.step, rs.layer) == (gs.kind, gs.k1_key, gs.k2_key, gs.step,
                                                                      gs.layer)
        assert rs.captures[0].manifest["producer"]["tool"] == "k3verify recorder"
        # what the recorder saw is what the generator wrote (two independent bookkeepings)
        for r in rs.ranks:
            for n, t in gs.captures[r].tensors.items():
                if n.startswith("dense.after."):  # the dense MLP runs outside the fused launches
                    assert rs.kind == "dense" and n not in rs.captures[r].tensors
                    continue
                assert bits_equal(rs.captures[r].tensors[n], t), (rp.name, r, n)
        # replay the recording through the reference
        if rs.has_k1:
            for r in rs.ranks:
                a = rs.k1_args(r)
                ref.kda_pre(rs.k1_key, **a)
                for n, want in rs.after(r, "k1").items():
                    assert bits_equal(a[n], want), (rp.name, r, n)
        if not rs.has_k2:
            continue
        ranks = rs.k2_world_args()
        ref.k2_world(rs.k2_key, ranks)
        for r in rs.ranks:
            for n, want in rs.after(r, "k2").items():
                assert bits_equal(ranks[r][n], want), (rp.name, r, n)
    # weights are stored once per (layer, rank, kernel), shared by both steps: K2 of layers 1-3, K1 of 0-2
    assert len(list((tmp_path / "rec" / "weights").glob("*.safetensors"))) == 3 * 2 + 3 * 2


def test_filter_and_budget(tmp_path):
    rec = Recorder(ref.kda_pre, ref.k2_launch, tmp_path / "f", budget_bytes=1 << 30, layers={1, 3}, steps={1},
                   cfg=TINY, quiet=True)
    drive(tmp_path / "g1", rec)
    assert [p.name for p in cap.discover(tmp_path / "f")] == ["s00001_l001", "s00001_l003"]
    assert not (tmp_path / "f" / "s00000_l001").exists()

    # steps are recorded whole: a budget one byte short of both steps stops before step 1 (a step
    # the size of step 0 would not fit), never leaving a partial step
    rec = Recorder(ref.kda_pre, ref.k2_launch, tmp_path / "w", budget_bytes=1 << 30, cfg=TINY, quiet=True)
    drive(tmp_path / "g2", rec)
    full = rec.close()
    step0 = sum(1 for p in rec.written if p.parent.name.startswith("s00000"))
    rec = Recorder(ref.kda_pre, ref.k2_launch, tmp_path / "b", budget_bytes=full["bytes"] - 1, cfg=TINY,
                   quiet=True)
    drive(tmp_path / "g3", rec)
    s = rec.close()
    sets = cap.discover(tmp_path / "b")
    assert [p.name for p in sets] == [f"s00000_l{i:03d}" for i in range(4)] and len(rec.written) == step0
    for p in sets:
        cap.load_set(p)  # complete and valid
    # every launch of step 1 goes unrecorded: 2 dense K1, 4 KDA K1, 6 K2
    assert s["skipped_by_reason"] == {"budget": 12} and any("stopped before step 1" in w for w in s["warnings"])

    # a budget that breaks step 0 in the middle: what was written of it is removed, the drop is said
    rec = Recorder(ref.kda_pre, ref.k2_launch, tmp_path / "m", budget_bytes=full["bytes"] // 4, cfg=TINY,
                   quiet=True)
    drive(tmp_path / "g4", rec)
    s = rec.close()
    assert not list((tmp_path / "m").rglob("rank*.safetensors")) and s["written"] == 0
    assert any("exceeded mid-step: step 0 dropped whole" in w for w in s["warnings"])


def test_records_transposed_cache_with_spare_slots(tmp_path, rng):
    """A deployment-style cache: transposed conv_state buffer, slots the step never touches."""
    cfg, L, R, layer = TINY.with_world(1), 2, 2, 1
    S, SL, slots = R * L, cfg.conv - 2 + L, 12
    w1 = rsynth.k1_weights(cfg, layer, 0)
    prefix, blocks, delta = rsynth.carry(cfg, S, layer, rng)
    conv = (torch.randn(slots, SL, cfg.qkv, generator=rng) * 0.8).to(torch.bfloat16).transpose(1, 2)
    rstate = torch.randn(slots, cfg.nh, cfg.hd, cfg.hd, generator=rng) * 0.05
    st = torch.tensor([[9, 4], [7, 11]], dtype=torch.int32)
    na = torch.tensor([2, 1], dtype=torch.int32)
    rec = Recorder(ref.kda_pre, ref.k2_launch, tmp_path, budget_bytes=1 << 30, cfg=cfg, quiet=True)
    kw = dict(prefix=prefix, delta=delta, blocks=blocks, conv_state=conv, rstate=rstate, st_idx=st, num_acc=na,
              core_out=torch.full((S, cfg.p), float("nan"), dtype=torch.bfloat16), layer=layer, **w1)
    conv_before, rs_before = conv.clone(), rstate.clone()
    rec.kda_pre(k1_build(cfg, layer, S, L, True, SL), **kw)
    w2 = rsynth.k2_weights(cfg, layer, 0, "bf16")
    k2 = dict(core=kw["core_out"].clone(), prefix=prefix.clone(), blocks=blocks.clone(),
              out=torch.empty(S, cfg.hidden, dtype=torch.bfloat16), layer=layer, **w2)
    ref.k2_world(k2_build(cfg, layer, S, "bf16"), [k2], launch=rec.k2_launch)
    (p,) = cap.discover(tmp_path)
    cs = cap.load_set(p)
    st_m = cs.captures[0].manifest["state"]
    assert {k: st_m[k] for k in ("slot_map", "conv_slots", "rec_slots", "conv_layout")} == \
        {"slot_map": "state.slot_map", "conv_slots": 12, "rec_slots": 12, "conv_layout": "slc"}
    # schema 2 stores the slots the step reads: conv st_idx[r, 0], recurrent st_idx[r, num_acc[r]-1]
    assert (st_m["conv_read"], st_m["rstate_read"]) == ([7, 9], [4, 7])
    assert (st_m["conv_written"], st_m["rstate_written"]) == ([7, 9], [4, 7, 9, 11])
    assert cs.captures[0].tensors["state.slot_map"].tolist() == [0, 4, 7, 9, 11]
    # full layout: the recorded slots back at their ids, same layout; replay matches the live run
    f = cs.k1_args(0, layout="full")
    assert f["conv_state"].stride(1) == 1
    assert torch.equal(f["conv_state"][[7, 9]], conv_before[[7, 9]])
    assert torch.equal(f["rstate"][[4, 7]], rs_before[[4, 7]])
    ref.kda_pre(cs.k1_key, **f)
    cw, rw = [7, 9], [4, 7, 9, 11]
    assert torch.equal(f["conv_state"][cw], conv[cw]) and torch.equal(f["rstate"][rw], rstate[rw])
    assert torch.equal(f["core_out"], kw["core_out"])
