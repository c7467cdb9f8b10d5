"""Capture format: lossless round trip, layouts, memory-mapped weights, and strict loading
(every bad input of DESIGN §8 / issue B1 raises InputError naming the field and the file)."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import capture as cap
from harness.cli import main as cli_main
from harness.errors import InputError
from ref import synth as rsynth
from ref.config import get_config, k1_build, k2_build

pytestmark = pytest.mark.cpu

TINY = get_config("tiny")
BF16 = torch.bfloat16


def _bf(shape, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(BF16)


def build_set(root, g, *, layer=1, step=3, R=3, L=2, fmt="mxfp4", pad=1, conv_layout="csl", with_delta=True,
              tweak=None):
    """Write a hand-built KDA capture set (world 2) of random tensors; return (path, records).

    `tweak(rec)` may edit each StepRecord before it is written (bad-input tests)."""
    cfg = TINY
    S, SL = R * L, cfg.conv - 2 + L
    slots = 1 + 3 * R * L
    ids = (torch.randperm(slots - 1, generator=g) + 1).to(torch.int32)
    st = ids[:R * L].reshape(R, L).clone()
    st[R - pad:] = torch.tensor([0, -1] * R, dtype=torch.int32)[:pad, None]
    na = torch.randint(1, L + 1, (R,), generator=g, dtype=torch.int32)
    smap = cap.slot_map_for(st, L)
    recs = []
    for r in range(cfg.world):
        w1 = rsynth.k1_weights(cfg, layer, r)
        w2 = rsynth.k2_weights(cfg, layer, r, fmt)
        a1, a2 = cap.store_weights(root, w1), cap.store_weights(root, w2)
        if conv_layout == "slc":
            conv = _bf((slots, SL, cfg.qkv), g).transpose(1, 2)
        else:
            conv = _bf((slots, cfg.qkv, SL), g)
        rst = torch.randn(slots, cfg.nh, cfg.hd, cfg.hd, generator=g) * 0.05
        k1_in = dict(prefix=_bf((S, cfg.hidden), g), delta=_bf((S, cfg.hidden), g) if with_delta else None,
                     blocks=_bf((S, cfg.nbmax, cfg.hidden), g), conv_state=cap.compact_cache(conv, smap),
                     rstate=cap.compact_cache(rst, smap), st_idx=st, num_acc=na)
        k1_after = dict(prefix=_bf((S, cfg.hidden), g), blocks=_bf((S, cfg.nbmax, cfg.hidden), g),
                        conv_state=_bf((len(smap), cfg.qkv, SL), g), rstate=torch.randn(len(smap), cfg.nh, cfg.hd,
                                                                                         cfg.hd, generator=g),
                        core_out=_bf((S, cfg.p), g))
        k2_in = dict(core=k1_after["core_out"], prefix=k1_after["prefix"], blocks=k1_after["blocks"])
        k2_after = dict(prefix=_bf((S, cfg.hidden), g), out=_bf((S, cfg.hidden), g), blocks=k1_after["blocks"])
        rec = cap.StepRecord(step=step, layer=layer, rank=r, world=cfg.world, kind="kda", fmt=fmt,
                             k2_key=k2_build(cfg, layer, S, fmt), k2_in=k2_in, k2_weights=a2, k2_after=k2_after,
                             k1_key=k1_build(cfg, layer, S, L, with_delta, SL), k1_in=k1_in, k1_weights=a1,
                             k1_after=k1_after, slot_map=smap, conv_slots=slots, rec_slots=slots,
                             conv_layout=cap.conv_layout_of(conv), cfg=cfg, meta={"test": [1, 2]})
        if tweak:
            tweak(rec)
        recs.append(rec)
    prod = cap.producer("test", git=False)
    paths = [cap.write_capture(root, rec, prod) for rec in recs]
    return paths[0].parent, recs


def rewrite(path, man_fn=None, tensor_fn=None):
    """Rewrite a capture file in place with an edited manifest and/or tensors (test tampering)."""
    hdr, man = cap._read_header(path)
    ts = load_file(str(path))
    if man_fn:
        man_fn(man)
    if tensor_fn:
        tensor_fn(ts)
    path.unlink()
    save_file(ts, str(path), metadata={cap.META_KEY: json.dumps(man)})


def expect_error(path, field, match=None):
    with pytest.raises(InputError) as e:
        cap.load_set(path)
    assert e.value.field == field, str(e.value)
    assert e.value.where and str(path) in e.value.where or str(path) in str(e.value), str(e.value)
    if match:
        assert match in e.value.msg, str(e.value)
    return e.value


# --------------------------------------------------------------------------- round trip

def _read_written(rec):
    """Compact positions of the slots a step reads / writes, by a plain loop over st_idx."""
    smap, L = rec.slot_map.tolist(), rec.k1_key.qlen
    conv_r, rs_r, conv_w, rs_w = set(), set(), set(), set()
    for row, a in zip(rec.k1_in["st_idx"].tolist(), rec.k1_in["num_acc"].tolist()):
        conv_r.add(max(row[0], 0))
        if row[0] > 0:
            conv_w.add(row[0])
        if row[a - 1] > 0:
            rs_r.add(row[a - 1])
            rs_w |= {v for v in row[:L] if v > 0}
    pos = lambda ids: [smap.index(i) for i in sorted(ids)]  # noqa: E731
    return pos(conv_r), pos(rs_r), pos(conv_w), pos(rs_w)


def test_round_trip_lossless(tmp_path, rng):
    path, recs = build_set(tmp_path, rng)
    cs = cap.load_set(path)
    assert (cs.layer, cs.kind, cs.step, cs.world, cs.fmt) == (1, "kda", 3, 2, "mxfp4")
    assert cs.cfg == TINY and cs.k1_key == recs[0].k1_key and cs.k2_key == recs[0].k2_key
    for r, rec in enumerate(recs):
        m = cs.captures[r].manifest
        assert m["producer"]["tool"] == "test" and m["meta"] == {"test": [1, 2]} and m["rank"] == r
        assert m["schema"] == 2 and m["bank_rows"] == TINY.nbmax
        conv_r, rs_r, conv_w, rs_w = _read_written(rec)
        # schema 2 stores what the step reads: the read slots, the bank rows below nblocks
        nb1, nb2 = rec.k1_key.nblocks, rec.k2_key.nblocks
        rows_after = nb1 + (rec.k1_key.write_idx >= 0)
        want = {"k1.in.conv_state": rec.k1_in["conv_state"][conv_r], "k1.in.rstate": rec.k1_in["rstate"][rs_r],
                "k1.in.blocks": rec.k1_in["blocks"][:, :nb1], "k1.after.conv_state": rec.k1_after["conv_state"][conv_w],
                "k1.after.rstate": rec.k1_after["rstate"][rs_w], "k1.after.blocks": rec.k1_after["blocks"][:, :rows_after],
                "k2.in.blocks": rec.k2_in["blocks"][:, :nb2], "k2.after.blocks": rec.k2_after["blocks"][:, :nb2]}
        for grp, d in (("k1.in.", rec.k1_in), ("k1.after.", rec.k1_after), ("k2.in.", rec.k2_in),
                       ("k2.after.", rec.k2_after)):
            for n, t in d.items():
                if t is None:
                    assert grp + n not in cs.captures[r].tensors
                    continue
                t = want.get(grp + n, t)
                got = cs.captures[r].tensors[grp + n]
                assert got.dtype == t.dtype and got.shape == t.shape, n
                assert torch.equal(cap.same_bits(got, t.contiguous()), torch.ones(t.shape, dtype=torch.bool)), n
        assert torch.equal(cs.captures[r].tensors["state.slot_map"], rec.slot_map)
        # after(): the written slots/rows over the input as loaded (unstored slots poisoned)
        a1, c1 = cs.after(r, "k1"), cs.k1_args(r)
        assert torch.equal(a1["rstate"][rs_w], rec.k1_after["rstate"][rs_w])
        keep = sorted(set(range(len(rec.slot_map))) - set(rs_w))
        assert cap.same_bits(a1["rstate"][keep], c1["rstate"][keep]).all()
        # weights come back bit-exact from their content-addressed file
        w = cs.weights(r, "k2")
        for n, t in rsynth.k2_weights(TINY, 1, r, "mxfp4").items():
            assert t is None and n not in w or torch.equal(w[n], t), n
    # K2's inputs equal K1's outputs: stored once, aliased
    alias = cs.captures[0].manifest["alias"]
    assert alias["k2.in.core"] == "k1.after.core_out"


def test_args_layouts(tmp_path, rng):
    path, recs = build_set(tmp_path, rng)
    cs = cap.load_set(path)
    rec = recs[1]
    smap = rec.slot_map.tolist()
    c = cs.k1_args(1)
    assert list(c) == [*cap.abi.K1_NAMES]
    # compact: caches are the carried slots (the read ones stored, the rest poison); st_idx remapped
    _, rs_r, _, _ = _read_written(rec)
    unread = sorted(set(range(len(smap))) - set(rs_r))
    assert torch.equal(c["rstate"][rs_r], rec.k1_in["rstate"][rs_r]) and c["conv_state"].shape[0] == len(smap)
    assert unread and (c["rstate"][unread] == cap.POISON_FINITE).all()
    for row_c, row_o in zip(c["st_idx"].tolist(), rec.k1_in["st_idx"].tolist()):
        assert [smap[v] if v > 0 else v for v in row_c] == row_o
    # full: original slot count, carried slots at their ids, the rest poison
    f = cs.k1_args(1, layout="full")
    assert f["rstate"].shape[0] == rec.rec_slots and torch.equal(f["st_idx"], rec.k1_in["st_idx"])
    assert torch.equal(f["rstate"][smap], c["rstate"])
    other = sorted(set(range(rec.rec_slots)) - set(smap))
    poison = cap.poison_(torch.empty(len(other), *f["rstate"].shape[1:]), finite=True)
    assert cap.same_bits(f["rstate"][other], poison).all()
    assert cap.same_bits(f["core_out"], cap.poison_(torch.empty_like(f["core_out"]))).all()
    # every call gives fresh state tensors
    c2 = cs.k1_args(1)
    c2["prefix"].add_(1)
    assert torch.equal(cs.k1_args(1)["prefix"], rec.k1_in["prefix"])
    k2 = cs.k2_args(0)
    assert "rank" not in k2 and "comm" not in k2 and k2["layer"] == 1
    assert torch.equal(k2["core"], recs[0].k2_in["core"])


def test_transposed_conv_state(tmp_path, rng):
    path, recs = build_set(tmp_path, rng, conv_layout="slc")
    cs = cap.load_set(path)
    assert cs.captures[0].manifest["state"]["conv_layout"] == "slc"
    conv = cs.k1_args(0)["conv_state"]
    assert conv.stride(1) == 1 and conv.stride(2) == conv.shape[1]
    conv_r = _read_written(recs[0])[0]
    assert torch.equal(conv[conv_r], recs[0].k1_in["conv_state"][conv_r])


def test_weights_shared_and_memory_mapped(tmp_path, rng):
    build_set(tmp_path, rng, step=0)
    build_set(tmp_path, rng, step=1)  # same layer, same weights: no new weight files
    assert len(list((tmp_path / "weights").glob("*.safetensors"))) == 4  # 2 ranks × (k1, k2)
    wp = next((tmp_path / "weights").glob("*.safetensors"))
    w = cap.load_weights(wp)
    name, t = max(w.items(), key=lambda kv: kv[1].numel())
    # The tensor is a view of the file: rewrite its bytes in place and the view sees them.
    hdr, _ = cap._read_header(wp)
    (n,) = struct.unpack("<Q", wp.read_bytes()[:8])
    start = 8 + n + hdr[name]["data_offsets"][0]
    before = t.reshape(-1).view(torch.uint8)[0].item()
    with open(wp, "r+b") as f:
        f.seek(start)
        f.write(bytes([before ^ 0xFF]))
    assert t.reshape(-1).view(torch.uint8)[0].item() == before ^ 0xFF


def test_discover_orders_sets(tmp_path, rng):
    for step, layer in ((2, 1), (0, 1), (10, 1)):
        build_set(tmp_path / "caps", rng, step=step, layer=layer)
    got = cap.discover(tmp_path / "caps")
    assert [p.name for p in got] == ["s00000_l001", "s00002_l001", "s00010_l001"]
    assert cap.discover(got[0] / "rank0.safetensors") == [got[0]]
    with pytest.raises(InputError):
        cap.discover(tmp_path / "nope")


# --------------------------------------------------------------------------- strict loading

def test_truncated_file(tmp_path, rng):
    path, _ = build_set(tmp_path, rng)
    f = path / "rank1.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    expect_error(path, "file", "truncated")
    f.write_bytes(data[:5])
    expect_error(path, "file", "truncated")


def test_corrupt_header_and_data(tmp_path, rng):
    path, _ = build_set(tmp_path, rng)
    f = path / "rank0.safetensors"
    data = bytearray(f.read_bytes())
    good = bytes(data)
    data[8:20] = b"\xff" * 12
    f.write_bytes(bytes(data))
    expect_error(path, "file", "corrupt")
    # a flipped bit in the data is caught by that tensor's sha256
    data = bytearray(good)
    data[-3] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(InputError) as e:
        cap.load_set(path)
    assert "sha256 mismatch" in e.value.msg and e.value.field.startswith(("k1.", "k2.", "state."))


def test_unknown_schema_version(tmp_path, rng):
    path, _ = build_set(tmp_path, rng)
    rewrite(path / "rank0.safetensors", man_fn=lambda m: m.update(schema=99))
    expect_error(path, "manifest.schema", "unknown schema version 99")


def test_manifest_hash_mismatch(tmp_path, rng):
    path, _ = build_set(tmp_path, rng)
    rewrite(path / "rank1.safetensors",
            man_fn=lambda m: m["tensors"]["k1.in.prefix"].update(sha256="0" * 64))
    expect_error(path, "k1.in.prefix", "sha256 mismatch")


def test_tensor_edited_without_manifest(tmp_path, rng):
    path, _ = build_set(tmp_path, rng)
    rewrite(path / "rank0.safetensors", tensor_fn=lambda ts: ts["k1.in.rstate"].mul_(2))
    expect_error(path, "k1.in.rstate", "sha256 mismatch")


def test_missing_rank(tmp_path, rng):
    path, _ = build_set(tmp_path, rng)
    (path / "rank1.safetensors").unlink()
    expect_error(path, "rank", "missing rank(s) [1]")


def test_shape_and_dtype_vs_manifest(tmp_path, rng):
    path, _ = build_set(tmp_path, rng)
    rewrite(path / "rank0.safetensors", man_fn=lambda m: m["tensors"]["k1.in.blocks"].update(shape=[1, 2, 3]))
    expect_error(path, "k1.in.blocks", "manifest says")
    path2, _ = build_set(tmp_path / "b", rng)
    rewrite(path2 / "rank0.safetensors", man_fn=lambda m: m["tensors"]["k1.in.prefix"].update(dtype="float32"))
    expect_error(path2, "k1.in.prefix", "manifest says")


def test_shape_vs_abi_and_config(tmp_path, rng):
    def narrow(rec):  # a consistent file whose prefix has the wrong hidden size
        rec.k1_in["prefix"] = rec.k1_in["prefix"][:, :64].contiguous()

    path, _ = build_set(tmp_path, rng, tweak=narrow)
    with pytest.raises(InputError) as e:
        cap.load_set(path)
    assert e.value.field in ("k1.in.prefix", "k1.in.blocks", "k1.in.delta"), str(e.value)
    assert "the config says" in e.value.msg

    def dtype(rec):
        rec.k1_in["rstate"] = rec.k1_in["rstate"].to(BF16)

    path, _ = build_set(tmp_path / "d", rng, tweak=dtype)
    expect_error(path, "k1.in.rstate", "dtype bfloat16")


@pytest.mark.parametrize("bad", [0, 3, -1])
def test_num_acc_outside_range(tmp_path, rng, bad):
    def t(rec):
        rec.k1_in["num_acc"] = rec.k1_in["num_acc"].clone()
        rec.k1_in["num_acc"][1] = bad

    path, _ = build_set(tmp_path, rng, L=2, tweak=t)
    expect_error(path, "k1.in.num_acc", f"num_acc[1] = {bad} outside 1..2")


def test_slot_outside_cache(tmp_path, rng):
    def small(rec):
        rec.rec_slots = int(rec.slot_map.max())  # the largest carried id no longer fits

    path, _ = build_set(tmp_path, rng, tweak=small)
    with pytest.raises(InputError) as e:
        cap.load_set(path)
    assert e.value.field in ("state.slot_map", "k1.in.st_idx") and "outside" in e.value.msg

    def conv_small(rec):
        rec.conv_slots = int(rec.k1_in["st_idx"][:, 0].max())

    path, _ = build_set(tmp_path / "c", rng, tweak=conv_small)
    expect_error(path, "k1.in.st_idx", "outside the conv cache")

    path, recs = build_set(tmp_path / "u", rng, R=2, L=2, pad=0)
    free = min(set(range(1, recs[0].rec_slots)) - set(recs[0].slot_map.tolist()))

    def uncarried(ts):  # st_idx points at a slot the capture does not carry (a writer cannot make it)
        ts["k1.in.st_idx"][0, 0] = free

    rewrite(path / "rank0.safetensors", tensor_fn=uncarried)
    expect_error(path, "k1.in.st_idx", "not carried")


@pytest.mark.parametrize("name", ["prefix", "delta", "rstate", "conv_state"])
def test_nan_in_input(tmp_path, rng, name):
    def t(rec):
        x = rec.k1_in[name].clone()
        x.reshape(x.shape[0], -1)[:, 7] = float("nan")  # every slot: a read one among them
        rec.k1_in[name] = x

    path, _ = build_set(tmp_path, rng, tweak=t)
    expect_error(path, f"k1.in.{name}", "NaN")


def test_nan_in_k2_input_and_weights(tmp_path, rng):
    def t(rec):
        rec.k2_in = dict(rec.k2_in, core=rec.k2_in["core"].clone())
        rec.k2_in["core"][0, 0] = float("inf")

    path, _ = build_set(tmp_path, rng, tweak=t)
    expect_error(path, "k2.in.core", "NaN or Inf")

    w = rsynth.k1_weights(TINY, 1, 0)
    w["w_in"] = w["w_in"].clone()
    w["w_in"][3, 3] = float("nan")
    addr = cap.store_weights(tmp_path / "w", w)
    with pytest.raises(InputError) as e:
        cap.load_weights(tmp_path / "w" / "weights" / f"{addr}.safetensors")
    assert e.value.field == "weights.w_in"


def test_missing_weight_file(tmp_path, rng):
    path, recs = build_set(tmp_path, rng)
    (tmp_path / "weights" / f"{recs[1].k2_weights}.safetensors").unlink()
    expect_error(path, "weights.k2", "not found")


def test_inconsistent_ranks(tmp_path, rng):
    path, _ = build_set(tmp_path, rng)
    rewrite(path / "rank1.safetensors", man_fn=lambda m: m.update(step=4))
    expect_error(path, "manifest.step", "differs")


def test_writer_never_overwrites(tmp_path, rng):
    path, recs = build_set(tmp_path, rng)
    before = (path / "rank0.safetensors").read_bytes()
    with pytest.raises(InputError) as e:
        cap.write_capture(tmp_path, recs[0], cap.producer("test", git=False))
    assert e.value.field == "out" and "already exists" in e.value.msg
    assert (path / "rank0.safetensors").read_bytes() == before
    assert not list(path.glob(".*.tmp"))


def test_untouched_masks(tmp_path, rng):
    path, recs = build_set(tmp_path, rng, R=3, L=2, pad=1)
    cs = cap.load_set(path)
    st, na = recs[0].k1_in["st_idx"].tolist(), recs[0].k1_in["num_acc"].tolist()
    smap = recs[0].slot_map.tolist()
    # independent small loop: which original slots does K1 write?
    conv_w = {row[0] for row in st if row[0] > 0}
    rs_w = {v for row, a in zip(st, na) if row[a - 1] > 0 for v in row[:2] if v > 0}
    for layout in ("compact", "full"):
        u = cs.untouched(0, layout)
        ids = smap if layout == "compact" else list(range(recs[0].rec_slots))
        assert {ids[s] for s in u.conv_written} == conv_w
        assert {ids[s] for s in set(range(len(ids))) - set(u.rstate_slots)} == rs_w
        assert u.k1_block_rows == [b for b in range(TINY.nbmax) if b != recs[0].k1_key.write_idx]
        m = u.masks()
        args = cs.k1_args(0, layout=layout)
        after = {k: args[k].clone() for k in ("conv_state", "rstate", "blocks")}
        assert u.violations(args, after) == {}
        s = u.rstate_slots[0]
        after["rstate"][s, 0, 0, 0] += 1  # a write into a protected slot is caught
        after["conv_state"][u.conv_written[0], 0, u.conv_keep_from - 1] += 1  # a written position is allowed
        assert u.violations(args, after) == {"rstate": 1}
        assert m["rstate"].shape == args["rstate"].shape


# --------------------------------------------------------------------------- CLI: one line, exit 2

def test_cli_bad_input_one_line(tmp_path, rng, capsys):
    assert cli_main(["synth", "--config", "nope", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config" in err[0]
    assert cli_main(["synth", "--steps", "many", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps" in err[0]
