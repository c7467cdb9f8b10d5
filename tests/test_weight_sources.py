"""Weight sources of a capture (DESIGN §8): stored, recipe (regenerated, digest-checked) and
checkpoint reference (HF shards + TP slice + layout plan); the per-process WeightCache; and
the bad sources, each one line naming file and field, exit 2, nothing written."""
from __future__ import annotations

import json

import pytest
import torch

import checkpoint_fixture as ckf
from harness import capture as cap
from harness.cli import main as cli_main
from harness.errors import InputError
from ref import synth as rsynth
from ref.config import get_config
from test_capture import build_set, rewrite

pytestmark = pytest.mark.cpu

TINY = get_config("tiny")
LAYER = 1


def _want(which, r, fmt="mxfp4"):
    return {n: t for n, t in rsynth.weights(which, TINY, LAYER, r, fmt if which == "k2" else None).items()
            if t is not None}


def _same(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return ckf.write_checkpoint(tmp_path_factory.mktemp("ckpt") / "kimi", TINY, [LAYER], "mxfp4")


def _with(entries):
    """build_set tweak: name each rank's weights by entries[(rank, which)]."""
    def t(rec):
        rec.k1_weights = entries[rec.rank, "k1"]
        rec.k2_weights = entries[rec.rank, "k2"]
    return t


def test_checkpoint_plan_gives_every_ranks_weights(ckpt):
    for r in range(TINY.world):
        for which in ("k1", "k2"):
            e, ts = cap.checkpoint_source(ckpt, TINY, LAYER, r, which, "mxfp4" if which == "k2" else None)
            _same(ts, _want(which, r))
            assert e["source"] == "checkpoint" and len(json.dumps(e)) < 20000


def test_recipe_and_checkpoint_sets_load_like_stored(tmp_path, rng, ckpt):
    rec_e = {(r, w): cap.recipe_source(TINY, LAYER, r, "mxfp4" if w == "k2" else None, 0, w)[0]
             for r in range(2) for w in ("k1", "k2")}
    ck_e = {(r, w): cap.checkpoint_source(ckpt, TINY, LAYER, r, w, "mxfp4" if w == "k2" else None)[0]
            for r in range(2) for w in ("k1", "k2")}
    for name, ents in (("recipe", rec_e), ("checkpoint", ck_e)):
        path, _ = build_set(tmp_path / name, rng, tweak=_with(ents))
        cs = cap.load_set(path, verify="full")
        for r in cs.ranks:
            assert cs.captures[r].manifest["weights"]["k2"]["source"] == name
            _same(cs.weights(r, "k1"), _want("k1", r))
            _same(cs.weights(r, "k2"), _want("k2", r))
            a = cs.k2_args(r)
            assert torch.equal(a["w13"], _want("k2", r)["w13"])


def test_cache_shares_weights_and_never_clones(tmp_path, rng, monkeypatch):
    ents = {(r, w): cap.recipe_source(TINY, LAYER, r, "mxfp4" if w == "k2" else None, 0, w)[0]
            for r in range(2) for w in ("k1", "k2")}
    p0, _ = build_set(tmp_path, rng, step=0, tweak=_with(ents))
    p1, _ = build_set(tmp_path, rng, step=1, tweak=_with(ents))
    cap.CACHE.clear()
    h0, m0 = cap.CACHE.hits, cap.CACHE.misses
    a, b = cap.load_set(p0), cap.load_set(p1)
    assert cap.CACHE.misses - m0 == 4  # 2 ranks × (k1, k2), generated once for both sets
    wa, wb = a.weights(0, "k2"), b.weights(0, "k2")
    assert all(wa[n].data_ptr() == wb[n].data_ptr() for n in wa)  # shared, not copied
    assert a.k2_args(0)["w13"].data_ptr() == wa["w13"].data_ptr()  # the launch gets the cached tensor
    assert cap.CACHE.hits > h0
    # verify="full" regenerates and re-checks instead of reusing
    m1 = cap.CACHE.misses
    cap.load_set(p0, verify="full")
    assert cap.CACHE.misses - m1 == 4
    # a budget of 0 keeps nothing
    monkeypatch.setenv(cap.CACHE_ENV, "0")
    cap.CACHE.clear()
    cap.load_set(p0)
    assert cap.CACHE.bytes == 0
    monkeypatch.setenv(cap.CACHE_ENV, "lots")
    with pytest.raises(InputError) as e:
        cap.load_set(p0)
    assert e.value.field == cap.CACHE_ENV


def test_stored_file_verified_once_per_identity(tmp_path, rng):
    path, _ = build_set(tmp_path, rng)
    cap.load_set(path)
    wp = sorted((tmp_path / "weights").glob("*.safetensors"))[0]
    calls = []
    real = cap.sources.tensor_sha256
    cap.sources.tensor_sha256 = lambda t: calls.append(1) or real(t)
    try:
        cap.load_weights(wp)  # same (path, size, mtime_ns, address): not hashed again
        assert not calls
        cap.load_weights(wp, verify="full")
        assert calls
    finally:
        cap.sources.tensor_sha256 = real


# --------------------------------------------------------------------------- bad sources

def _replay_fails(path, field, match, capsys, tmp_path):
    """`k3verify replay` on a bad set: exit 2, one stderr line naming the file and the field,
    no report written."""
    cap.CACHE.clear()
    out = tmp_path / "report.json"
    rc = cli_main(["replay", str(path), "--backend", "ref", "--device", "cpu", "--quiet", "--json", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "rank0.safetensors" in err[0] and f": {field}" in err[0] and match in err[0], err[0]
    assert not out.exists()


def _ck_set(tmp_path, rng, ckpt_root):
    ents = {(r, w): cap.checkpoint_source(ckpt_root, TINY, LAYER, r, w, "mxfp4" if w == "k2" else None)[0]
            for r in range(2) for w in ("k1", "k2")}
    path, _ = build_set(tmp_path / "set", rng, tweak=_with(ents))
    return path


def test_missing_shard(tmp_path, rng, capsys):
    root = ckf.write_checkpoint(tmp_path / "ck", TINY, [LAYER], "mxfp4")
    path = _ck_set(tmp_path, rng, root)
    sorted(root.glob("model-*.safetensors"))[1].unlink()
    _replay_fails(path, "weights.k1.", "missing from checkpoint", capsys, tmp_path)


def test_absent_tensor_name(tmp_path, rng, capsys):
    root = ckf.write_checkpoint(tmp_path / "ck", TINY, [LAYER], "mxfp4")
    path = _ck_set(tmp_path, rng, root)
    idx = root / "model.safetensors.index.json"
    wm = json.loads(idx.read_text())
    del wm["weight_map"][f"language_model.layers.{LAYER}.self_attn.A_log"]
    idx.write_text(json.dumps(wm))
    _replay_fails(path, "weights.k1.a_log", "absent from checkpoint", capsys, tmp_path)


def test_slice_out_of_range(tmp_path, rng, capsys):
    root = ckf.write_checkpoint(tmp_path / "ck", TINY, [LAYER], "mxfp4")
    path = _ck_set(tmp_path, rng, root)

    def far(m):
        part = m["weights"]["k1"]["tensors"]["a_log"]["parts"][0]
        part["narrow"] = [0, 10_000, part["narrow"][2]]
    rewrite(path / "rank0.safetensors", man_fn=far)
    _replay_fails(path, "weights.k1.a_log", "out of range", capsys, tmp_path)


def _recipe_set(tmp_path, rng):
    ents = {(r, w): cap.recipe_source(TINY, LAYER, r, "mxfp4" if w == "k2" else None, 0, w)[0]
            for r in range(2) for w in ("k1", "k2")}
    path, _ = build_set(tmp_path / "set", rng, tweak=_with(ents))
    return path


def test_unknown_generator_version(tmp_path, rng, capsys):
    path = _recipe_set(tmp_path, rng)
    rewrite(path / "rank0.safetensors", man_fn=lambda m: m["weights"]["k2"].update(version=99))
    _replay_fails(path, "weights.k2.version", "version 99 is unknown", capsys, tmp_path)


def test_recipe_digest_mismatch(tmp_path, rng, capsys):
    path = _recipe_set(tmp_path, rng)
    rewrite(path / "rank0.safetensors",
            man_fn=lambda m: m["weights"]["k1"]["tensors"]["conv_w"].update(digest="k3mix32x4:" + "0" * 64))
    _replay_fails(path, "weights.k1.tensors.conv_w.digest", "digest differs", capsys, tmp_path)


def test_checkpoint_digest_mismatch(tmp_path, rng, capsys):
    root = ckf.write_checkpoint(tmp_path / "ck", TINY, [LAYER], "mxfp4")
    path = _ck_set(tmp_path, rng, root)
    # another checkpoint in the same place: same names and shapes, other values
    shard = next(f for f in sorted(root.glob("model-*.safetensors"))
                 if f"language_model.layers.{LAYER}.self_attn.dt_bias" in cap.read_header(f).tensors)
    from safetensors.torch import load_file, save_file

    ts = load_file(str(shard))
    ts[f"language_model.layers.{LAYER}.self_attn.dt_bias"] += 1.0
    shard.unlink()
    save_file(ts, str(shard))
    _replay_fails(path, "weights.k1.dt_bias.digest", "differs from the one recorded", capsys, tmp_path)
