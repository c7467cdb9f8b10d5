"""The FlyDSL kernels' index maps (fast/flydsl/layouts.py), evaluated by FlyDSL's own
layout algebra on the CPU, against the intended mapping written out as loops — and,
where the reference already encodes the mapping (in_proj column blocks, packed
nibbles, top-k rows), against the reference's own code. Plus the linker discovery,
the ISA-metadata reader and the cache-key coverage of every build-key field."""
from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
import torch

pytestmark = pytest.mark.cpu

fly = pytest.importorskip("flydsl", reason="flydsl not installed")

from fast.flydsl import layouts as L  # noqa: E402
from fast.flydsl import toolchain  # noqa: E402


def _all(shape):
    return list(itertools.product(*[range(n) for n in shape]))


def _colex(shape):
    """Coordinates in index order of a compact colexicographic layout (first mode fastest)."""
    return [tuple(reversed(c)) for c in itertools.product(*[range(n) for n in reversed(shape)])]


@pytest.mark.parametrize("lpr", [1, 2, 8, 16, 64])
def test_lane_split(lpr):
    spec = L.lane_split(lpr)
    got = L.evaluate(spec, indices=range(64))
    want = []
    for lane in range(64):
        want.append((lane % lpr, lane // lpr))
    assert got == want
    # a group's lanes are adjacent and aligned: xor offsets below lpr stay in the group
    for lane in range(64):
        for off in (o for o in (1, 2, 4, 8, 16, 32) if o < lpr):
            assert got[lane ^ off][1] == got[lane][1]


@pytest.mark.parametrize("ksplit,groups", [(1, 4), (2, 2), (4, 1)])
def test_gemv_waves(ksplit, groups):
    got = L.evaluate(L.gemv_waves(ksplit, groups), indices=range(ksplit * groups))
    assert got == [(w % ksplit, w // ksplit) for w in range(ksplit * groups)]
    assert sorted(got) == sorted((k, g) for k in range(ksplit) for g in range(groups))


@pytest.mark.parametrize("K,N", [(7168, 6288), (7168, 896), (3584, 896), (1536, 7168), (768, 7168), (128, 160),
                                 (32, 64), (7168, 3584)])
def test_gemv_chunks_cover_k_once(K, N):
    """Every 8-element chunk of K is added by exactly one (lane, step, split) of the planned
    GEMV, the masked tail lanes add nothing, and a split's chunks are contiguous."""
    from fast.flydsl import kernels as KN

    sp = KN.plan_gemv("t", 8, N, K, "bf16")
    lpr, cps, ks = sp.lpr, sp.chunks_per_split, sp.ksplit
    full, tail = cps // lpr, cps % lpr
    steps = full + (1 if tail else 0)
    spec = L.gemv_chunks(lpr, steps, ks, cps)
    pts = _all((lpr, steps, ks))
    got = L.evaluate(spec, coords=pts)
    taken = []
    for (klane, it, k), c in zip(pts, got):
        if it < full or klane < tail:  # the kernel's mask on the last step
            assert k * cps <= c < (k + 1) * cps
            taken.append(c)
    assert sorted(taken) == list(range(K // 8))
    # the lanes of one step read adjacent chunks (one coalesced 16·lpr-byte row segment)
    for k in range(ks):
        row = [c for (kl, it, kk), c in zip(pts, got) if it == 0 and kk == k]
        assert row == list(range(k * cps, k * cps + lpr))


def test_gemv_plan_reaches_the_wave_target_or_the_split_limit():
    from fast.flydsl import kernels as KN

    for K, N in [(7168, 6288), (7168, 896), (3584, 896), (1536, 7168), (768, 7168)]:
        sp = KN.plan_gemv("t", 8, N, K, "bf16")
        assert sp.ksplit in (1, 2, 4) and (K // 8) % sp.ksplit == 0 and sp.chunks_per_split >= sp.lpr
        waves = sp.grid * sp.waves
        if sp.ksplit < 4 and waves < KN.GEMV_WAVES:
            nxt = dataclasses.replace(sp, ksplit=sp.ksplit * 2)
            assert (K // 8) % nxt.ksplit or nxt.chunks_per_split < nxt.lpr, (K, N, sp)
        assert sp.grid * sp.rows_per_block >= N > (sp.grid - 1) * sp.rows_per_block


@pytest.mark.parametrize("hd,ks", [(16, 4), (32, 4), (16, 2), (8, 8), (128, 8), (16, 8)])
def test_kda_split_and_columns(hd, ks):
    split, kcol = L.kda_split(hd, ks), L.kda_kcol(hd, ks)
    coords = L.evaluate(split, indices=range(hd * ks))
    assert sorted(coords) == sorted((kq, v) for kq in range(ks) for v in range(hd))  # a bijection
    for tid, (kq, v) in enumerate(coords):
        assert (kq, v) == (tid % ks, tid // ks)
        for off in (o for o in (1, 2, 4, 8, 16, 32) if o < ks):
            assert coords[tid ^ off][1] == v  # the k-split partners of a row share a wave and its v
    kc = hd // ks
    cols = L.evaluate(kcol, coords=_all((kc, ks)))
    want = []
    for i, kq in _all((kc, ks)):
        want.append(kq * kc + i)
    assert cols == want
    assert sorted(cols) == list(range(hd))


@pytest.mark.parametrize("threads,ept", [(64, 4), (16, 1), (32, 3)])
def test_experts_of_thread(threads, ept):
    got = L.evaluate(L.experts_of_thread(threads, ept), coords=_all((threads, ept)))
    want = [t + threads * i for t, i in _all((threads, ept))]
    assert got == want
    assert sorted(got) == list(range(threads * ept))


def test_pick_rows_match_topk_ids_flattening():
    S, K = 5, 3
    ids = torch.arange(S * K).reshape(S, K)  # what topk_ids [S, K] row-major holds
    spec = L.pick(K, S)
    rows = L.evaluate(spec, coords=_all((K, S)))
    for (k, t), p in zip(_all((K, S)), rows):
        assert ids.flatten()[p] == ids[t, k]
    assert L.evaluate(spec, indices=range(S * K)) == [(p % K, p // K) for p in range(S * K)]


@pytest.mark.parametrize("nh,hd,rank", [(2, 16, 16), (12, 128, 128)])
def test_proj_heads_against_reference_split(nh, hd, rank):
    from ref.in_proj import split

    P = nh * hd
    proj = torch.arange(4 * P + rank + nh + 5).unsqueeze(0)  # column ids as values
    parts = split(proj, nh, hd, rank)
    spec = L.proj_heads(nh, hd)
    pts = [(i, h, b) for i in (0, 1, hd - 1) for h in range(nh) for b in range(4)]
    got = L.evaluate(spec, coords=pts)
    for (i, h, b), col in zip(pts, got):
        name = ("q", "k", "v", "g2")[b]
        assert int(parts[name][0, h * hd + i]) == col
    ps = sorted({*range(min(P, 40)), hd - 1, hd, P - hd, P - 1})
    heads = L.evaluate(L.head_channel(nh, hd), indices=ps)
    assert heads == [(p % hd, p // hd) for p in ps]


@pytest.mark.parametrize("kblocks", [1, 2, 7])
def test_packed_block_against_reference_nibbles(kblocks, rng):
    from ref.quant import pack_nibbles, unpack_nibbles

    K = 32 * kblocks
    codes = torch.randint(0, 16, (K,), generator=rng, dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert torch.equal(unpack_nibbles(packed), codes)
    spec = L.packed_block(kblocks)
    pts = _all((2, 16, kblocks))
    ks = L.evaluate(spec, coords=pts)
    assert sorted(ks) == list(range(K))
    for (nib, byte, blk), k in zip(pts, ks):
        b = int(packed[16 * blk + byte])
        assert ((b >> (4 * nib)) & 15) == int(codes[k])
    # the kernels read a block's 16 bytes as 4 little-endian u32 words: word wi, nibble n
    words = packed.numpy().view("<u4").reshape(kblocks, 4)
    for blk, wi, n in _all((kblocks, 4, 8)):
        assert (int(words[blk, wi]) >> (4 * n)) & 15 == int(codes[32 * blk + 8 * wi + n])


@pytest.mark.parametrize("length,vec", [(128, 8), (64, 32), (24, 4)])
def test_row_chunks(length, vec):
    pts = _all((vec, length // vec))
    got = L.evaluate_chunks(length, vec, pts)
    assert got == [i * vec + e for e, i in pts]


# ---------------------------------------------------------------- build keys reach the cache key

def _alt(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v * 0.5 - 0.25
    return {"mxfp4": "int4", "int4": "bf16", "bf16": "mxfp4"}[v]


@pytest.mark.parametrize("which", ["k1", "k2"])
def test_every_build_key_field_changes_a_kernel(which):
    """Each field of the build key changes the spec (hence the symbol name, hence the
    IR FlyDSL hashes) of at least one launch of the build."""
    from fast.flydsl import build as B
    from fast.flydsl import dims_for
    from ref.config import get_config, k1_build, k2_build

    cfg = get_config("tiny")
    d1, d2 = dims_for(cfg, 8, 4)
    if which == "k1":
        key = k1_build(cfg, 3, 8, 4, True, d1["SL"])
        key = dataclasses.replace(key, write_idx=0)
        prog = lambda k: B.k1_program(k, B.K1Dims(**d1))  # noqa: E731
    else:
        key = k2_build(cfg, 3, 8, "mxfp4")
        prog = lambda k: B.k2_program(k, B.K2Dims(**d2))  # noqa: E731
    base = {st.kernel for st in prog(key).launches}
    for f in dataclasses.fields(key):
        v = getattr(key, f.name)
        alt = _alt(v)
        if f.name == "qlen":
            alt = 2
        if f.name == "tokens" and which == "k1":
            continue  # tokens and qlen move together (S = R·L); qlen covers the pair
        k2 = dataclasses.replace(key, **{f.name: alt})
        if which == "k1" and f.name == "qlen":
            p = B.k1_program(k2, B.K1Dims(**{**d1, "L": 2}))
        elif f.name == "tokens":
            p = B.k2_program(k2, B.K2Dims(**{**d2, "S": alt}))
        else:
            p = prog(k2)
        assert {st.kernel for st in p.launches} != base, f"{which}: field {f.name} reaches no kernel"


def test_weight_dtypes_reach_the_kernels():
    """conv_w and the router bias in fp32 (what vLLM passes) or bf16 compile to different
    conv / top-k kernels, and the compile placeholders carry that dtype."""
    from fast.flydsl import build as B
    from fast.flydsl import dims_for
    from ref.config import get_config, k1_build, k2_build

    cfg = get_config("tiny")
    kern = {}
    for dt in ("f32", "bf16"):
        d1, d2 = dims_for(cfg, 8, 4, conv_w=dt, bias=dt)
        k1 = k1_build(cfg, 1, 8, 4, True, d1["SL"])
        k2 = k2_build(cfg, 1, 8, "mxfp4")
        D1, D2 = B.K1Dims(**d1), B.K2Dims(**d2)
        assert B.k1_abi_shapes(k1, D1)["conv_w"][1] == B.DTYPES[dt]
        assert B.k2_abi_shapes(k2, D2)["bias"][1] == B.DTYPES[dt]
        conv = next(st for st in B.k1_program(k1, D1).launches if st.factory == "conv")
        topk = next(st for st in B.k2_program(k2, D2).launches if st.factory == "topk")
        assert conv.spec.w_dtype == dt and topk.spec.bias == dt
        kern[dt] = (conv.kernel, topk.kernel)
    assert kern["f32"][0] != kern["bf16"][0] and kern["f32"][1] != kern["bf16"][1]
    assert dims_for(cfg, 8, 4)[0]["conv_w"] == "f32" and dims_for(cfg, 8, 4)[1]["bias"] == "f32"


def test_a8w4_program():
    """a8w4: the latent is MXFP8-quantized (lat_mx8q) and the expert GEMMs read those fp32
    values with MXFP4 weights and uint8 E8M0 scales."""
    from fast.flydsl import build as B
    from fast.flydsl import dims_for
    from ref.config import get_config, k2_build

    cfg = get_config("tiny")
    _, d2 = dims_for(cfg, 8, 4)
    D2 = B.K2Dims(**d2)
    key = k2_build(cfg, 1, 8, "a8w4")
    prog = B.k2_program(key, D2)
    labels = [st.label for st in prog.launches]
    assert "k2.lat_mx8q" in labels and "k2.lat_mxq" not in labels
    up = next(st for st in prog.launches if st.label.startswith("k2.experts_up"))
    act = next(st for st in prog.launches if st.label.startswith("k2.experts_act"))
    assert up.args[0] == "latq" and up.spec.fmt == "a8w4" and act.spec.fmt == "a8w4"
    sh = B.k2_abi_shapes(key, D2)
    assert sh["w13"] == ((cfg.experts, 2 * cfg.ri, cfg.lat // 2), torch.uint8)
    assert sh["w13s"] == ((cfg.experts, 2 * cfg.ri, cfg.lat // 32), torch.uint8)
    mx = {st.kernel for st in B.k2_program(k2_build(cfg, 1, 8, "mxfp4"), D2).launches}
    assert {st.kernel for st in prog.launches if "experts" in st.label or "lat_mx" in st.label}.isdisjoint(mx)


# ---------------------------------------------------------------- toolchain

def test_ld_lld_shim_and_message(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "ld.lld-19"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "no-rocm"))
    monkeypatch.setattr(toolchain, "_candidates", lambda: [str(fake)])
    rp, how = toolchain.find_ld_lld()
    assert rp and os.path.realpath(os.path.join(rp, "llvm", "bin", "ld.lld")) == str(fake)
    assert str(fake) in how
    good = tmp_path / "rocm"
    (good / "llvm" / "bin").mkdir(parents=True)
    os.symlink(fake, good / "llvm" / "bin" / "ld.lld")
    monkeypatch.setenv("ROCM_PATH", str(good))
    assert toolchain.find_ld_lld()[0] == str(good)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "no-rocm"))
    monkeypatch.setattr(toolchain, "_candidates", lambda: [])
    rp, how = toolchain.find_ld_lld()
    assert rp is None and "ld.lld not found" in how and "lld-19" in how


def test_parse_isa_picks_the_named_kernel():
    text = """
	.amdgpu_metadata
---
amdhsa.kernels:
  - .agpr_count:     4
    .args:
      - .offset:         0
        .size:           8
    .group_segment_fixed_size: 96
    .max_flat_workgroup_size: 64
    .name:           other
    .private_segment_fixed_size: 16
    .sgpr_count:     9
    .sgpr_spill_count: 0
    .vgpr_count:     7
    .vgpr_spill_count: 1
    .wavefront_size: 64
  - .agpr_count:     0
    .args:
      - .offset:         0
        .size:           8
    .group_segment_fixed_size: 2048
    .max_flat_workgroup_size: 256
    .name:           k3_x
    .private_segment_fixed_size: 0
    .sgpr_count:     33
    .sgpr_spill_count: 0
    .vgpr_count:     128
    .vgpr_spill_count: 0
    .wavefront_size: 64
amdhsa.target:   amdgcn-amd-amdhsa--gfx950
	.end_amdgpu_metadata
"""
    assert toolchain.parse_isa(text, "k3_x") == dict(vgpr=128, agpr=0, sgpr=33, lds=2048, scratch=0, vgpr_spill=0,
                                                     sgpr_spill=0, wavefront=64, wg_size=256)
    assert toolchain.parse_isa(text, "other")["scratch"] == 16
    with pytest.raises(toolchain.ToolchainError):
        toolchain.parse_isa(text, "missing")


def test_available_reason_here():
    from fast import available, load_backend

    ok, why = available(load_backend("flydsl"))
    if not ok:
        assert why in ("no ROCm device", "flydsl not installed") or why.startswith(("ld.lld not found", "no ROCm"))


def test_launch_validation_names_the_field():
    from conftest import TINY, make_k1, make_k2

    from fast.flydsl.abi_check import k1_dims, k2_dims
    from ref.abi import ArgError
    from ref.comm import SimWorld

    key, kw = make_k1(TINY, 5, layer=1, R=2, L=4)
    args = {k: v for k, v in kw.items() if k != "layer"}
    with pytest.raises(ArgError) as e:
        k1_dims(key, args)
    assert e.value.field == "prefix" and "ROCm device" in str(e.value)  # CPU tensors: checks passed up to here
    with pytest.raises(ArgError) as e:
        k1_dims(dataclasses.replace(key, tokens=7), args)
    assert e.value.field == "key.tokens"
    with pytest.raises(ArgError) as e:
        k1_dims(dataclasses.replace(key, delta=False), args)
    assert e.value.field == "delta"
    key2, ranks = make_k2(TINY, 5, layer=1, fmt="mxfp4", S=8)
    a2 = {k: v for k, v in ranks[0].items() if k != "layer"}
    with pytest.raises(ArgError) as e:
        k2_dims(key2, a2, 0, SimWorld(1))
    assert e.value.field == "w_up"
    with pytest.raises(ArgError) as e:
        k2_dims(key2, a2, 0, SimWorld(2))
    assert e.value.field == "prefix"
    with pytest.raises(ArgError) as e:
        k2_dims(dataclasses.replace(key2, experts="fp8"), a2, 0, SimWorld(2))
    assert e.value.field == "key.experts"
