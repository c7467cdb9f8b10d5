"""`k3verify compile`: compile every FlyDSL build a replay of a config needs, for
each named arch, without running anything (FlyDSL's compile-only mode), and print
the ISA resources of every kernel: vgpr, sgpr, LDS, scratch, code size, seconds.

The builds are those of the config's layer schedule at S = R·L tokens (default:
L = num_spec + 1 = 4, R = 8 // L): K1 for every KDA layer (a pending delta on all but
layer 0), K2 for every MoE layer (not the dense layer 0), with the arch's expert formats
(gfx950: mxfp4 and a8w4, gfx942: int4) unless --experts says otherwise, and the weight
dtypes vLLM passes (conv_w and the router bias fp32) unless --conv-w / --bias say bf16.
mxfp4 and a8w4 are gfx950 formats: vLLM runs them only there, and gfx942 does not build
them. Identical kernels are compiled once. Occupancy is waves per SIMD from the VGPRs,
SGPRs, LDS and workgroup size of each kernel (fast/flydsl/occupancy.py states the rule).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .errors import InputError

ARCH_FORMAT = {"gfx950": ("mxfp4", "a8w4"), "gfx942": ("int4",)}  # what vLLM runs there
ARCH_FORMATS = {"gfx950": ("bf16", "mxfp4", "int4", "a8w4"), "gfx942": ("bf16", "int4")}  # what builds


def _formats(arch: str, experts: str) -> tuple[str, ...]:
    if experts == "auto":
        return ARCH_FORMAT[arch]
    if experts == "all":
        return ARCH_FORMATS[arch]
    if experts not in ARCH_FORMATS[arch]:
        raise InputError("--experts", f"{experts} is not a {arch} target (vLLM runs mxfp4 and a8w4 only on gfx950; "
                                      f"{arch} builds {', '.join(ARCH_FORMATS[arch])})")
    return (experts,)


def builds(cfg, tokens: int, qlen: int, fmts: tuple[str, ...], conv_w: str = "f32", bias: str = "f32"):
    """[(key, dims)] of one replay of `cfg`'s layer schedule (distinct keys, first use order)."""
    from fast.flydsl import dims_for
    from ref.config import k1_build, k2_build

    d1, d2 = dims_for(cfg, tokens, qlen, conv_w=conv_w, bias=bias)
    seen, out = set(), []
    for i in range(cfg.layers):
        keys = []
        if cfg.has_k1(i):
            keys.append((k1_build(cfg, i, tokens, qlen, i > 0, d1["SL"]), d1))
        if cfg.has_k2(i):  # the dense layer 0 runs no K2
            keys += [(k2_build(cfg, i, tokens, f), d2) for f in fmts]
        for k, d in keys:
            if k not in seen:
                seen.add(k)
                out.append((k, d))
    return out


def launches(cfg, tokens: int, qlen: int, fmts, conv_w: str = "f32", bias: str = "f32"):
    """Distinct launches (one compile each) over every build, with the builds using each."""
    from fast.flydsl import build as B
    from ref.config import KdaPreBuild

    found: dict = {}
    for key, d in builds(cfg, tokens, qlen, fmts, conv_w, bias):
        if isinstance(key, KdaPreBuild):
            dims = B.K1Dims(**d)
            prog, shapes = B.k1_program(key, dims), B.k1_abi_shapes(key, dims)
        else:
            dims = B.K2Dims(**d)
            prog, shapes = B.k2_program(key, dims), B.k2_abi_shapes(key, dims)
        for st in prog.launches:
            ent = found.setdefault((st.factory, st.spec), dict(launch=st, prog=prog, shapes=shapes, builds=0))
            ent["builds"] += 1
    return list(found.values())


def run(cfg_name: str, archs: list[str], tokens: int, qlen: int, experts: str, isa_dir: str | None = None,
        progress: bool = True, conv_w: str = "f32", bias: str = "f32") -> dict:
    from tqdm import tqdm

    from fast.flydsl import build as B
    from fast.flydsl import toolchain
    from ref.config import get_config

    cfg = get_config(cfg_name)
    ok, how = toolchain.compile_ready()
    if not ok:
        raise RuntimeError(how)
    jobs = []
    for arch in archs:
        for ent in launches(cfg, tokens, qlen, _formats(arch, experts), conv_w, bias):
            jobs.append((arch, ent))
    rows = []
    t_all = time.perf_counter()
    bar = tqdm(jobs, desc=f"compile {cfg_name}", unit="kernel", file=sys.stderr, disable=not progress)
    for arch, ent in bar:
        st = ent["launch"]
        bar.set_postfix_str(f"{arch} {st.label}")
        sub = B.Program((st,), ent["prog"].scratch, ())
        keep = os.path.join(isa_dir, arch) if isa_dir else None
        row = B.compile_program(sub, ent["shapes"], arch, keep_dir=keep)[0]
        row["builds"] = ent["builds"]
        row["flag"] = " ".join(f for f, on in (("SCRATCH", row["scratch"]), ("VGPR-SPILL", row["vgpr_spill"]),
                                                ("SGPR-SPILL", row["sgpr_spill"])) if on)
        rows.append(row)
    return dict(config=cfg_name, tokens=tokens, qlen=qlen, experts=experts, conv_w=conv_w, bias=bias, archs=archs,
                formats={a: list(_formats(a, experts)) for a in archs}, flydsl=toolchain.flydsl_version(),
                linker=how, seconds=time.perf_counter() - t_all, kernels=rows)


def table(res: dict) -> str:
    from tabulate import tabulate

    hdr = ["kernel", "arch", "vgpr", "agpr", "sgpr", "LDS B", "scratch B", "threads", "waves/SIMD", "code B",
           "compile s", "builds", ""]
    body = [[r["name"], r["arch"], r["vgpr"], r["agpr"], r["sgpr"], r["lds"], r["scratch"], r["wg_size"],
             f"{r['waves']} ({r['waves_limit']})", r["code_bytes"] if r["code_bytes"] is not None else "?",
             f"{r['seconds']:.2f}", r["builds"], r["flag"]]
            for r in res["kernels"]]
    return tabulate(body, headers=hdr)


def cli(argv) -> int:
    ap = argparse.ArgumentParser(prog="k3verify compile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="flydsl", help="only flydsl compiles ahead of time")
    ap.add_argument("--arch", default="gfx942,gfx950", help="comma-separated: gfx942, gfx950")
    ap.add_argument("--config", default="tiny", help="tiny | small | k3-tp8")
    ap.add_argument("--num-spec", type=int, default=3, help="speculative tokens; L = num_spec + 1")
    ap.add_argument("--requests", type=int, default=None, help="R (default 8 // L, so S = R·L ≤ 8)")
    ap.add_argument("--experts", default="auto", choices=["auto", "all", "bf16", "mxfp4", "int4", "a8w4"],
                    help="expert formats to build (auto: mxfp4 and a8w4 on gfx950, int4 on gfx942; "
                         "mxfp4/a8w4 are gfx950 only)")
    ap.add_argument("--conv-w", default="f32", choices=["f32", "bf16"],
                    help="conv_w dtype (f32: vLLM's conv1d.weight)")
    ap.add_argument("--bias", default="f32", choices=["f32", "bf16"], help="router bias dtype")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--isa-dir", default=None, help="keep the dumped ISA (.s) of every kernel under this folder")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)

    from fast.flydsl.toolchain import ARCHS
    from ref.config import PRESETS

    if a.backend != "flydsl":
        raise InputError("--backend", f"{a.backend!r}: only the flydsl backend has a compile-only mode")
    archs = [s.strip() for s in a.arch.split(",") if s.strip()]
    bad = [s for s in archs if s not in ARCHS]
    if not archs or bad:
        raise InputError("--arch", f"{','.join(bad) or a.arch!r} not in {', '.join(ARCHS)}")
    if a.config not in PRESETS:
        raise InputError("--config", f"unknown preset {a.config!r} (known: {', '.join(PRESETS)})")
    if a.num_spec < 0:
        raise InputError("--num-spec", f"{a.num_spec} < 0")
    L = a.num_spec + 1
    R = a.requests if a.requests is not None else max(1, 8 // L)
    if R < 1 or R * L > 16:
        raise InputError("--requests", f"R·L = {R * L} tokens outside 1..16")
    for arch in archs:
        _formats(arch, a.experts)  # an expert format the arch does not build: exit 2 before compiling
    try:
        res = run(a.config, archs, R * L, L, a.experts, a.isa_dir, progress=not a.quiet, conv_w=a.conv_w,
                  bias=a.bias)
    except RuntimeError as e:
        print(f"k3verify compile: {e}", file=sys.stderr)
        return 1
    fmts = "; ".join(f"{arch}: {', '.join(f)}" for arch, f in res["formats"].items())
    print(f"FlyDSL {res['flydsl']} compile-only, {a.config}, S={R * L} (R={R}, L={L}), experts {fmts}, "
          f"conv_w {a.conv_w}, bias {a.bias}; linker: {res['linker']}; {len(res['kernels'])} kernels in "
          f"{res['seconds']:.1f} s")
    if "gfx942" in archs and a.experts in ("auto", "all"):
        print("gfx942 builds no mxfp4 / a8w4 experts: vLLM runs those formats only on gfx950")
    print(table(res))
    flagged = [r for r in res["kernels"] if r["flag"]]
    if flagged:
        print(f"{len(flagged)} kernel(s) use scratch or spill: " + ", ".join(f"{r['name']} [{r['arch']}]"
                                                                       for r in flagged))
    if a.json:
        keep = ("name", "arch", "vgpr", "agpr", "sgpr", "lds", "scratch", "vgpr_spill", "sgpr_spill", "wg_size",
                "waves", "waves_limit", "code_bytes", "seconds", "kernel", "builds")
        doc = {k: v for k, v in res.items() if k != "kernels"}
        doc["kernels"] = [{k: r[k] for k in keep} for r in res["kernels"]]
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, a.json)
    return 0
