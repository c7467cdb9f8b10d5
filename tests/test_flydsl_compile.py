"""FlyDSL builds compiled for gfx942 and gfx950 without running them (FlyDSL's
compile-only mode), ISA resources read from the dumped ISA and cross-checked against
the code object's own metadata. Nothing here executes a kernel."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytestmark = pytest.mark.flydsl_compile

pytest.importorskip("flydsl", reason="flydsl not installed")

from fast.flydsl import build as B  # noqa: E402
from fast.flydsl import compile_build, dims_for, toolchain  # noqa: E402
from ref.config import get_config, k1_build, k2_build  # noqa: E402

_ok, _why = toolchain.compile_ready()
if not _ok:
    pytest.skip(_why, allow_module_level=True)

LDS_LIMIT = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
FMT = {"gfx942": "int4", "gfx950": "mxfp4"}
# issue L's budget at k3-tp8: ≤ 128 VGPRs (4 waves of 512 registers per SIMD lane), no
# scratch, ≥ 4 waves per SIMD (fast/flydsl/occupancy.py) for the GEMV programs (dense
# projections, the AttnRes seams that feed them, the routed-expert GEMMs) — and, as
# compiled today, for every other kernel too
BUDGET_VGPR, BUDGET_WAVES = 128, 4
GEMV_PROGRAMS = ("k1.attnres", "k1.in_proj", "k2.o_proj", "k2.attnres", "k2.router", "k2.lat_down", "k2.shared_gu",
                 "k2.shared_down", "k2.experts_up", "k2.experts_down", "k2.up_proj")
K1_STAGES = ("k1.attnres", "k1.in_proj", "k1.conv", "k1.gate", "k1.kda")
K2_STAGES = ("k2.o_proj", "k2.attnres", "k2.router", "k2.topk", "k2.lat_down", "k2.shared_gu", "k2.shared_situ",
             "k2.shared_down", "k2.experts_up", "k2.experts_act", "k2.experts_down", "k2.latent_norm",
             "k2.fin_init", "k2.up_proj", "k2.out")


def _check_rows(rows, arch, expect_n):
    assert len(rows) == expect_n
    for r in rows:
        assert r["arch"] == arch
        assert r["wavefront"] == 64
        assert 0 < r["vgpr"] + r["agpr"] <= 512, r
        assert 0 < r["sgpr"] <= 108, r
        assert 0 <= r["lds"] <= LDS_LIMIT[arch], r
        assert r["scratch"] == 0 and r["vgpr_spill"] == 0 and r["sgpr_spill"] == 0, f"scratch/spills: {r}"
        assert r["code_bytes"] and r["code_bytes"] > 64, r
        assert r["kernel"].startswith("k3_")
        assert 1 <= r["waves"] <= 8 and r["waves_limit"] in ("vgpr", "sgpr", "lds", "wg", "max"), r


def _over_budget(rows):
    return [f"{r['name']} [{r['arch']}]: vgpr {r['vgpr']}, scratch {r['scratch']}, {r['waves']} waves"
            for r in rows if r["vgpr"] > BUDGET_VGPR or r["scratch"] or r["waves"] < BUDGET_WAVES]


def test_cli_tiny_both_archs_every_format(tmp_path, capsys):
    from harness.compile_cmd import cli

    out = tmp_path / "tiny.json"
    rc = cli(["--backend", "flydsl", "--arch", "gfx942,gfx950", "--config", "tiny", "--experts", "all",
              "--json", str(out), "--quiet"])
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = doc["kernels"]
    for r in rows:
        assert set(r) >= {"name", "arch", "vgpr", "sgpr", "lds", "scratch", "code_bytes", "seconds"}
        assert r["scratch"] == 0 and r["vgpr"] > 0 and r["code_bytes"] > 0 and r["seconds"] > 0
    for arch in ("gfx942", "gfx950"):
        names = [r["name"] for r in rows if r["arch"] == arch]
        for st in K1_STAGES + K2_STAGES:
            assert any(n.startswith(st) for n in names), f"{arch}: {st} not compiled"
        fmts = {n.split()[-1] for n in names if n.startswith("k2.experts_up")}
        assert fmts == ({"bf16", "mxfp4", "int4", "a8w4"} if arch == "gfx950" else {"bf16", "int4"})
        assert all(set(r) >= {"waves", "waves_limit", "wg_size"} for r in rows)
    assert {r["arch"] for r in rows if r["name"] in ("k2.lat_mxq", "k2.lat_mx8q")} == {"gfx950"}
    assert doc["formats"] == {"gfx942": ["bf16", "int4"], "gfx950": ["bf16", "mxfp4", "int4", "a8w4"]}
    assert doc["conv_w"] == "f32" and doc["bias"] == "f32"
    assert {r["name"] for r in rows} >= {"k1.conv w=f32", "k2.topk k=4 bias=f32"}
    text = capsys.readouterr().out
    assert "k1.kda+gated_norm" in text and "vgpr" in text and "scratch B" in text and "waves/SIMD" in text
    assert "gfx942 builds no mxfp4 / a8w4 experts" in text


def test_cli_refuses_a_format_the_arch_does_not_build(capsys):
    from harness.cli import main

    assert main(["compile", "--arch", "gfx942", "--config", "tiny", "--experts", "a8w4", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--experts" in err[0] and "a8w4 is not a gfx942 target" in err[0]


def test_bf16_weight_variants_compile(tmp_path):
    """conv_w and the router bias in bf16 (also accepted) compile next to the fp32 ones."""
    from harness.compile_cmd import cli

    out = tmp_path / "bf16w.json"
    assert cli(["--arch", "gfx942", "--config", "tiny", "--conv-w", "bf16", "--bias", "bf16", "--json", str(out),
                "--quiet"]) == 0
    rows = json.loads(out.read_text())["kernels"]
    names = {r["name"] for r in rows}
    assert "k1.conv w=bf16" in names and "k2.topk k=4 bias=bf16" in names and "k1.conv w=f32" not in names
    assert all(r["scratch"] == 0 for r in rows)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_k3_tp8_builds_within_budget(arch):
    """Block-write K1 and reset K2 builds of k3-tp8 with the most AttnRes sources (layer 84:
    K1 over 7 bank rows, writing row 7; K2 over 8), the next layer's K1 over 8: every
    kernel ≤ 128 VGPRs, no scratch, ≥ 4 waves per SIMD."""
    cfg = get_config("k3-tp8")
    d1, d2 = dims_for(cfg, 8, 4)
    assert d1["conv_w"] == "f32" and d2["bias"] == "f32"  # what vLLM passes
    rows = []
    for layer in (84, 85):
        k1 = k1_build(cfg, layer, 8, 4, True, d1["SL"])
        got = compile_build(k1, arch, **d1)
        _check_rows(got, arch, len(B.k1_program(k1, B.K1Dims(**d1)).launches))
        rows += got
    k2 = k2_build(cfg, 84, 8, FMT[arch])
    assert k2.reset and k2.nblocks == 8
    got = compile_build(k2, arch, **d2)
    _check_rows(got, arch, len(B.k2_program(k2, B.K2Dims(**d2)).launches))
    rows += got
    assert {r["name"].split()[0] for r in rows} >= set(GEMV_PROGRAMS)
    assert not _over_budget(rows), _over_budget(rows)


def test_k3_tp8_a8w4_gfx950():
    """The a8w4 expert format (MXFP4 weights, MXFP8 activations) at k3-tp8 for gfx950: its
    latent quantizer and expert kernels compile without scratch, within the budget."""
    cfg = get_config("k3-tp8")
    _, d2 = dims_for(cfg, 8, 4)
    key = k2_build(cfg, 13, 8, "a8w4")
    rows = compile_build(key, "gfx950", **d2)
    _check_rows(rows, "gfx950", len(B.k2_program(key, B.K2Dims(**d2)).launches))
    names = [r["name"] for r in rows]
    assert "k2.lat_mx8q" in names and "k2.experts_up a8w4" in names and "k2.experts_act a8w4" in names
    assert not _over_budget(rows), _over_budget(rows)


def test_k1_debug_build_and_transposed_conv_state():
    """The taps build compiles, and so does the conv kernel for a [slots, SL, C] buffer
    viewed as [slots, C, SL] (unit stride on C: another specialization)."""
    cfg = get_config("tiny")
    d1, _ = dims_for(cfg, 8, 4)
    key = k1_build(cfg, 1, 8, 4, True, d1["SL"])
    rows = compile_build(key, "gfx950", debug=True, **d1)
    assert any("(taps)" in r["name"] for r in rows)
    dims = B.K1Dims(**d1)
    prog = B.k1_program(key, dims)
    shapes = B.k1_abi_shapes(key, dims)
    conv = next(st for st in prog.launches if st.factory == "conv")
    bufs = B.placeholders(shapes, prog.scratch)
    cs = torch.empty(4, dims.SL, 3 * dims.P, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    assert cs.stride()[1] == 1
    from fast.flydsl.toolchain import compile_measure

    args = tuple(cs if a == "conv_state" else bufs[a] for a in conv.args)
    res = compile_measure(conv.fn, args, conv.kernel, "gfx942")
    assert res.scratch == 0 and res.vgpr > 0


def test_spec_reaches_the_compiled_symbol_and_cache_key():
    """Two specs that differ in one epsilon compile to different symbols and artifacts."""
    from fast.flydsl import kernels as KN
    from fast.flydsl.toolchain import compile_measure

    a = torch.empty(4, 64, device="meta")
    w = torch.empty(64, dtype=torch.bfloat16, device="meta")
    o = torch.empty(4, 64, dtype=torch.bfloat16, device="meta")
    keys = []
    for eps in (1e-5, 1e-6):
        sp = KN.EwSpec("rms", 4, 64, eps=eps)
        fn = KN.ew(sp)
        name = KN.kernel_name("ew_rms", sp)
        compile_measure(fn, (a, w, o), name, "gfx942")
        art_key, art = fn._last_compiled
        assert f"@{name}" in art._source_ir
        keys.append((name, art_key))
    assert keys[0][0] != keys[1][0] and keys[0][1] != keys[1][1]
    sp = dataclasses.replace(KN.EwSpec("rms", 4, 64, eps=1e-6), eps=1e-5)
    assert KN.ew(sp) is KN.ew(KN.EwSpec("rms", 4, 64, eps=1e-5))  # memoized on the spec


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_cli_k3_tp8_every_build(tmp_path, arch):
    """Every kernel of every K1/K2 build of the k3-tp8 layer schedule (all 93 layers), no scratch."""
    from harness.compile_cmd import cli

    out = tmp_path / "k3.json"
    assert cli(["--backend", "flydsl", "--arch", arch, "--config", "k3-tp8", "--json", str(out), "--quiet"]) == 0
    rows = json.loads(out.read_text())["kernels"]
    assert len(rows) > 40, len(rows)
    bad = [r for r in rows if r["scratch"] or r["vgpr"] <= 0 or r["code_bytes"] <= 0]
    assert not bad, bad[:3]
    names = [r["name"] for r in rows]
    for st in K1_STAGES + K2_STAGES:
        assert any(n.startswith(st) for n in names), f"{arch}: {st} not compiled"
    assert ("k2.experts_up a8w4" in names) == (arch == "gfx950")
    assert not _over_budget(rows), _over_budget(rows)
