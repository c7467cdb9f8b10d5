"""Synthetic generator: determinism, the reference reproduces what it wrote, the AttnRes carry
layer to layer, acceptance carried step to step through real slots, padding, MLA stand-in."""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import ref
from harness import capture as cap
from harness.cli import main as cli_main
from harness.errors import InputError
from harness.synth import synthesize
from ref import synth as rsynth
from ref.config import get_config

pytestmark = pytest.mark.cpu

TINY = get_config("tiny")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = int(hashlib.sha256(__name__.encode()).hexdigest()[:6], 16)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Every tiny layer, 3 steps, L = 2, 4 requests of which 2 are padding."""
    out = tmp_path_factory.mktemp("synth")
    sets = synthesize("tiny", "0-5", steps=3, num_spec=1, experts="mxfp4", seed=SEED, out=out, requests=4,
                      padding=2, progress=False, git=False)
    return out, {(cs.step, cs.layer): cs for cs in map(cap.load_set, sets)}


def bits_equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(cap.same_bits(a, b).all())


def test_layout_and_sizes(run):
    out, sets = run
    assert sorted(sets) == [(t, i) for t in range(3) for i in range(6)]
    for (t, i), cs in sets.items():
        assert cs.kind == TINY.kind(i) and cs.world == 2 and cs.fmt == "mxfp4"
        for r in cs.ranks:
            size = (cs.path / f"rank{r}.safetensors").stat().st_size
            assert size <= 100_000, (cs.name, size)
    # 2 ranks: one K2 weight file per MoE layer (not the dense layer 0), one K1 file per layer
    # with a K1 (KDA layers and the dense layer 0)
    n_k2 = sum(TINY.has_k2(i) for i in range(6))
    n_k1 = sum(TINY.has_k1(i) for i in range(6))
    assert (n_k2, n_k1) == (5, 4)
    # weights named by recipe (the default): no weight files, a recipe entry per launch and rank
    assert not (out / "weights").exists()
    for (t, i), cs in sets.items():
        for r in cs.ranks:
            w = cs.captures[r].manifest["weights"]
            assert [k for k in ("k1", "k2") if w[k]] == [k for k, has in (("k1", TINY.has_k1(i)),
                                                                           ("k2", TINY.has_k2(i))) if has]
            assert all(e["source"] == "recipe" and (e["layer"], e["rank"]) == (i, r) for e in w.values() if e)
            assert len(json.dumps(w)) < 8000


def test_stored_weights_flag(tmp_path):
    sets = synthesize("tiny", "0-2", steps=1, num_spec=1, experts="mxfp4", seed=SEED, out=tmp_path,
                      progress=False, git=False, weights="stored")
    n_k2 = sum(TINY.has_k2(i) for i in range(3))
    n_k1 = sum(TINY.has_k1(i) for i in range(3))
    assert len(list((tmp_path / "weights").glob("*.safetensors"))) == (n_k2 + n_k1) * 2
    rec = tmp_path / "recipe"
    sets_r = synthesize("tiny", "0-2", steps=1, num_spec=1, experts="mxfp4", seed=SEED, out=rec,
                        progress=False, git=False)
    for a, b in zip(sets, sets_r):  # the same launches, bit for bit, whichever way the weights are named
        ca, cb = cap.load_set(a), cap.load_set(b)
        for r in ca.ranks:
            assert ca.captures[r].manifest["weights"]["k1"]["source"] == "stored"
            for k in ("k1", "k2"):
                wa, wb = ca.weights(r, k), cb.weights(r, k)
                assert sorted(wa) == sorted(wb) and all(torch.equal(wa[n], wb[n]) for n in wa)
            assert ca.captures[r].manifest["tensors"] == cb.captures[r].manifest["tensors"]


def test_reference_reproduces_after(run):
    _, sets = run
    for (t, i), cs in sets.items():
        if cs.has_k1:
            for r in cs.ranks:
                a = cs.k1_args(r)
                ref.kda_pre(cs.k1_key, **a)
                for n, want in cs.after(r, "k1").items():
                    assert bits_equal(a[n], want), (cs.name, r, n)
                full = cs.k1_args(r, layout="full")
                before = {k: full[k].clone() for k in ("conv_state", "rstate", "blocks")}
                ref.kda_pre(cs.k1_key, **full)
                assert cs.untouched(r, "full").violations(before, full) == {}
                smap = cs.captures[r].tensors["state.slot_map"]
                assert bits_equal(full["rstate"][smap], cs.after(r, "k1")["rstate"])
        if not cs.has_k2:
            continue
        ranks = cs.k2_world_args()
        ref.k2_world(cs.k2_key, ranks)
        for r in cs.ranks:
            for n, want in cs.after(r, "k2").items():
                assert bits_equal(ranks[r][n], want), (cs.name, r, n)


def test_carry_layer_to_layer(run):
    _, sets = run
    for t in range(3):
        c0 = sets[t, 0].inputs(0, "k1")
        assert "delta" not in c0 and not sets[t, 0].k1_key.delta
        if sets[t, 0].k1_key.nblocks:  # layer 0 starts from the embedding (a row it reads)
            assert torch.equal(c0["prefix"], c0["blocks"][:, 0])
        for i in range(5):
            prev, nxt = sets[t, i], sets[t, i + 1]
            pa = prev.after(0, "k2" if prev.has_k2 else "dense")
            if not prev.has_k2:  # the dense layer's carry: K1's bank, the stand-in's prefix and out
                pa["blocks"] = prev.after(0, "k1")["blocks"]
            if nxt.kind == "kda":
                ni = nxt.inputs(0, "k1")
                assert torch.equal(ni["prefix"], pa["prefix"]) and torch.equal(ni["delta"], pa["out"])
                assert torch.equal(ni["blocks"], pa["blocks"])
            else:
                check_mla(nxt, pa, t)


def check_mla(cs, pa, t):
    """MLA stand-in against a small float64 loop: pending delta add, block write, AttnRes, input
    norm (K1 steps 1-3 with the layer's attention-side weights), then core = x @ mla_proj^T."""
    i = cs.layer
    k2 = cs.inputs(0, "k2")
    pre = (pa["prefix"].float() + pa["out"].float()).to(torch.bfloat16)
    assert torch.equal(k2["prefix"], pre)
    wi = TINY.write_idx(i)
    blocks = pa["blocks"].clone()
    if wi >= 0:
        blocks[:, wi] = pre
    assert torch.equal(k2["blocks"], blocks)
    w = rsynth.k1_weights(TINY, i, 0, SEED)
    c = [float(a) * float(b) for a, b in zip(w["ares_nw"].tolist(), w["ares_qk"].tolist())]
    nb = math.ceil(i / TINY.block_size)
    for r in cs.ranks:
        proj = rsynth.mla_proj(TINY, i, r, SEED).double()
        core = cs.inputs(r, "k2")["core"].double()
        for s in range(pre.shape[0]):
            srcs = [blocks[s, b].double().tolist() for b in range(nb)] + [pre[s].double().tolist()]
            logit = [sum(v * cc for v, cc in zip(src, c)) / math.sqrt(sum(v * v for v in src) / len(src) + TINY.eps)
                     for src in srcs]
            m = max(logit)
            p = [math.exp(x - m) for x in logit]
            p = [x / sum(p) for x in p]
            mixed = [sum(p[j] * srcs[j][d] for j in range(len(srcs))) for d in range(TINY.hidden)]
            rms = 1 / math.sqrt(sum(x * x for x in mixed) / TINY.hidden + TINY.norm_eps("out_eps"))
            x = torch.tensor([v * rms * float(g) for v, g in zip(mixed, w["in_nw"].tolist())], dtype=torch.float64)
            want = proj @ x
            err = (core[s] - want).abs().max() / want.abs().max()
            assert err < 2e-2, (cs.name, r, s, float(err))


def test_block_schedule(run):
    _, sets = run
    for (t, i), cs in sets.items():
        bw = i % TINY.block_size == 0
        if not cs.has_k2:
            assert cs.kind == "dense" and i == 0
            continue
        assert cs.k2_key.reset == bw and cs.k2_key.nblocks == math.ceil(i / TINY.block_size) + bw
        if cs.has_k1:
            assert cs.k1_key.write_idx == (i // TINY.block_size if bw else -1)
            assert cs.k1_key.nblocks == math.ceil(i / TINY.block_size)
            a = cs.after(0, "k1")
            if bw:
                assert torch.equal(a["blocks"][:, cs.k1_key.write_idx], a["prefix"])


def test_acceptance_through_slots(run):
    _, sets = run
    accs = set()
    for i in (0, 1, 2, 4):
        for t in range(1, 3):
            prev, cur = sets[t - 1, i], sets[t, i]
            for r in cur.ranks:
                pi, ci = prev.inputs(r, "k1"), cur.inputs(r, "k1")
                assert torch.equal(pi["st_idx"][:2], ci["st_idx"][:2])  # each live request keeps its slots
                pa = prev.after(r, "k1")
                # the cache persists: this step reads exactly what the previous step wrote
                rd, wr = cur.slots_read(r), prev.slots_read(r)
                assert prev.captures[r].tensors["state.slot_map"].tolist() == \
                    cur.captures[r].tensors["state.slot_map"].tolist()
                pos = lambda ids: [smap0.index(i) for i in ids]  # noqa: E731
                smap0 = cur.captures[r].tensors["state.slot_map"].tolist()
                for c, rl, wl in (("rstate", "rstate_read", "rstate_written"), ("conv_state", "conv_read",
                                                                                  "conv_written")):
                    both = pos(sorted(set(rd[rl]) & set(wr[wl])))
                    assert both and torch.equal(ci[c][both], pa[c][both]), c
                smap = cur.captures[r].tensors["state.slot_map"].tolist()
                for row, a in zip(ci["st_idx"].tolist(), ci["num_acc"].tolist()):
                    if row[0] <= 0:
                        continue
                    accs.add(a)
                    s0 = smap.index(row[a - 1])  # start slot: the a-th token's state of step t-1
                    assert torch.equal(ci["rstate"][s0], pa["rstate"][s0])
                    assert not torch.equal(ci["rstate"][s0], pi["rstate"][s0])  # it was rewritten
    assert accs == {1, 2}


def test_padding_requests(run):
    _, sets = run
    for t in (0, 1):  # the null slot of a padding row alternates 0 / -1 by row and step
        cs = sets[t, 1]
        st = cs.inputs(0, "k1")["st_idx"]
        z, m = ([0, 0], [-1, -1]) if t == 0 else ([-1, -1], [0, 0])
        assert st[:2].min() > 0 and st[2].tolist() == z and st[3].tolist() == m
        core = cs.after(0, "k1")["core_out"]
        assert core[4:].abs().max() == 0 and core[:4].abs().min() > 0  # padding rows: o = 0
        u = cs.untouched(0)
        assert 0 in u.rstate_slots and 0 in u.conv_slots


def test_same_command_same_bytes(tmp_path):
    args = ["synth", "--config", "tiny", "--layers", "2-3", "--steps", "2", "--num-spec", "1", "--experts", "int4",
            "--seed", "5", "--no-git", "-q"]
    assert cli_main(args + ["--out", str(tmp_path / "a")]) == 0
    env = dict(os.environ, PYTHONHASHSEED="123")
    subprocess.run([sys.executable, "-m", "harness.cli", *args, "--out", str(tmp_path / "b")], cwd=ROOT, env=env,
                   check=True, capture_output=True)
    fa = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    fb = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert fa == fb and len(fa) == 2 * 2 * 2  # captures only: the weights are named by recipe
    for p in fa:
        assert (tmp_path / "a" / p).read_bytes() == (tmp_path / "b" / p).read_bytes(), p


def test_explicit_acceptance_and_refusals(tmp_path, capsys):
    sets = synthesize("tiny", "1", steps=2, num_spec=3, experts="bf16", seed=1, out=tmp_path, requests=2,
                      padding=0, progress=False, git=False, num_acc=[[1, 4], [2, 3]])
    got = [cap.load_set(p).inputs(1, "k1")["num_acc"].tolist() for p in sets]
    assert got == [[1, 4], [2, 3]]
    before = {p: p.read_bytes() for p in tmp_path.rglob("rank*.safetensors")}
    with pytest.raises(InputError) as e:
        synthesize("tiny", "1", 2, 3, "bf16", 1, tmp_path, requests=2, padding=0, progress=False, git=False)
    assert e.value.field == "out"
    assert before == {p: p.read_bytes() for p in tmp_path.rglob("rank*.safetensors")}
    assert cli_main(["synth", "--layers", "1", "--steps", "2", "--num-spec", "3", "--experts", "bf16", "--seed",
                     "1", "--requests", "2", "--padding", "0", "--out", str(tmp_path), "-q", "--no-git"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exist" in err[0]
    for bad, field in ((dict(layers="4-9"), "layers"), (dict(experts="fp8"), "experts"), (dict(padding=2), "padding"),
                       (dict(num_acc=[[5, 1]], steps=1), "num_acc")):
        kw = dict(config="tiny", layers="1", steps=2, num_spec=3, experts="bf16", seed=1, out=tmp_path / "x",
                  requests=2, progress=False, git=False)
        kw.update(bad)
        with pytest.raises(InputError) as e:
            synthesize(**kw)
        assert e.value.field == field


# ------------------------------------------------------------------ the request mix (issue H)


@pytest.mark.parametrize("R,L,pad,steps", [(2, 4, 1, 2), (2, 4, 0, 1), (4, 2, 1, 1), (3, 3, 2, 2), (8, 1, 1, 1)])
def test_mix_covers_full_and_zero_extra_acceptance(R, L, pad, steps):
    """Every random run with R >= 2 shows a = L and a = 1 on live rows (in its first step when that
    step has two live rows), and both null slots when it has padding over two steps or rows."""
    from harness.synth import RequestMix

    for seed in range(20):
        mix = RequestMix(R, L, pad, steps, seed)
        seen, nulls = set(), set()
        for t in range(steps):
            ms = mix.step()
            seen |= {int(ms.num_acc[r]) for r in ms.live_rows()}
            nulls |= {int(ms.st_idx[r, 0]) for r in range(R) if not ms.live[r]}
            assert all(1 <= int(a) <= L for a in ms.num_acc)
        assert {1, L} <= seen, (seed, seen)
        if pad * steps >= 2:
            assert nulls == {0, -1}


def test_mix_modes_and_refusals():
    from harness.synth import RequestMix

    mix = RequestMix(2, 4, 0, 6, 0, accept="none-then-all")
    assert [mix.step().num_acc.tolist() for _ in range(6)] == [[1, 1]] * 3 + [[4, 4]] * 3
    mix = RequestMix(2, 4, 0, 2, 0, accept="all")
    assert mix.step().num_acc.tolist() == [4, 4]
    for kw, field in ((dict(accept="some"), "accept"), (dict(lifetime=-1), "lifetime")):
        with pytest.raises(InputError) as e:
            RequestMix(2, 4, 0, 2, 0, **kw)
        assert e.value.field == field


def test_requests_join_and_leave(tmp_path):
    """With a short lifetime requests leave (their row turns into padding: null slots, zero core)
    and join (fresh slots, zeroed before their first step: the capture shows K1 reading zeros)."""
    from harness.synth import RequestMix

    mix = RequestMix(3, 2, 1, 12, SEED, lifetime=2)
    steps = [mix.step() for _ in range(12)]
    ev = [e for ms in steps for e in ms.events]
    assert any(e.startswith("join") for e in ev) and any(e.startswith("leave") for e in ev)
    owned = [set(ms.st_idx[r].tolist()) for ms in steps for r in ms.live_rows()]
    for ms in steps:  # live requests never share a slot
        live = [s for r in ms.live_rows() for s in ms.st_idx[r].tolist()]
        assert len(live) == len(set(live)) and min(live, default=1) > 0
    assert len(owned) > 3
    sets = synthesize("tiny", "1", steps=12, num_spec=1, experts="bf16", seed=SEED, out=tmp_path, requests=3,
                      padding=1, progress=False, git=False, lifetime=2)
    checked = 0
    for t, p in enumerate(sets):
        cs = cap.load_set(p)
        ms = steps[t]
        assert torch.equal(cs.inputs(0, "k1")["st_idx"], ms.st_idx)
        smap = cs.captures[0].tensors["state.slot_map"].tolist()
        k1 = cs.inputs(0, "k1")
        rd = cs.slots_read(0)
        for s in ms.fresh:  # a fresh slot the step reads starts from zeros
            if s in rd["rstate_read"]:
                assert not k1["rstate"][smap.index(s)].any()
                checked += 1
            if s in rd["conv_read"]:
                assert not k1["conv_state"][smap.index(s)].any()
        core = cs.after(0, "k1")["core_out"]
        for r in range(3):
            if not ms.live[r]:
                assert core[2 * r:2 * r + 2].abs().max() == 0
    assert checked > 0
    assert cap.load_set(sets[0]).captures[0].manifest["meta"]["synth"]["lifetime"] == 2


def test_world_4(tmp_path):
    """--world 4 (one head a rank on tiny): the reference reproduces what synth wrote, K2 over four ranks."""
    assert cli_main(["synth", "--layers", "1-3", "--steps", "1", "--num-spec", "1", "--experts", "mxfp4", "--world",
                     "4", "--seed", "3", "--out", str(tmp_path), "-q", "--no-git"]) == 0
    for p in cap.discover(tmp_path):
        cs = cap.load_set(p)
        assert cs.world == 4 and len(cs.ranks) == 4
        if cs.has_k1:
            for r in cs.ranks:
                a = cs.k1_args(r)
                ref.kda_pre(cs.k1_key, **a)
                for n, want in cs.after(r, "k1").items():
                    assert bits_equal(a[n], want), (cs.name, r, n)
        ranks = cs.k2_world_args()
        ref.k2_world(cs.k2_key, ranks)
        for r in cs.ranks:
            for n, want in cs.after(r, "k2").items():
                assert bits_equal(ranks[r][n], want), (cs.name, r, n)
