"""K1 of the Triton backend at k3-tp8 rank 0 (issue L): TUNE variants timed side by side in one
process, each checked against the reference, and the per-program timeline of the two launches.

    PYTHONPATH=. python benchmarks/bench_k1.py [--cases 1x1,4x1,4x4,8x1,8x4]
        [--variants "rec_pdl=1;rec_flat=1;rec_pdl=1,rec_flat=1"] [--rounds 5] [--timeline 8x4,4x1] [--json F]

Per variant and case: K1 under CUDA-graph replay (median, NROT rotated copies of weights and
inputs, as bench_fast), each launch alone, the byte floor over a 4 GiB torch.sum's bandwidth
measured in the same run, and bench_fast.check_k1 against the eager reference (bookkeeping
bit-exact, core_out / new states by cosine) and health(). A variant that fails the check is
marked BAD and never counts as faster.

--timeline (NVIDIA): the first variant rebuilt with TUNE stamps (%globaltimer, ns) at the
start, after the wait and at the end of every program of k1_mid (its AttnRes phases by ticket,
the in_proj items after their wait for x) and of k1_rec (start, after the prefetch / wait,
chain end, end), read after one graph replay: when each phase ends, when the in_proj items
start streaming and finish, the gap to the recurrence and its parts (µs from k1_mid's first
program start).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_fast as bf  # noqa: E402
from ref import config as rcfg  # noqa: E402
from ref import synth  # noqa: E402


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def timeline(backend, sets, key1):
    """One graph replay of K1 with stamps on; per-phase times in µs from k1_mid's first start. The
    phase programs are counted with the settings of the build (k1_hc, k1_xc), as the launch did."""
    from fast.triton import _host
    from fast.triton.tuning import settings

    T = settings(key1.tokens)
    CH = _host._ares_dims(sets[0][1]["prefix"].shape[1], key1.nblocks, T["k1_hc"])["CH"]
    phases = 2 if T["k1_xc"] else 3

    fns = [lambda s=sets[0]: backend.kda_pre(s[0], **s[1])]
    bf.graph_time(fns, reps=3)
    sc = next(v for k, v in _host._SCRATCH.items() if k[0] == "k1" and k[1] == key1)
    mid = sc["tl_mid"].view(-1, 4).cpu().double()
    rec = sc["tl_rec"].view(-1, 4).cpu().double()
    t0 = float(mid[:, 0].min())
    mid = (mid - t0) / 1e3
    rec = (rec - t0) / 1e3
    S = key1.tokens
    n_ares = phases * S * CH
    out = {}
    for ph, name in enumerate(("A", "B", "C")[:phases]):
        rows = mid[ph * S * CH:(ph + 1) * S * CH]
        out[f"ares_{name}"] = dict(start_min=float(rows[:, 0].min()), start_max=float(rows[:, 0].max()),
                                   end_max=float(rows[:, 1].max()))
    g = mid[n_ares:]
    out["gemv"] = dict(n=int(g.shape[0]), start_min=float(g[:, 0].min()), start_max=float(g[:, 0].max()),
                       ready_med=float(g[:, 1].median()), ready_max=float(g[:, 1].max()),
                       end_min=float(g[:, 2].min()), end_p10=pct(g[:, 2].tolist(), 0.1),
                       end_med=float(g[:, 2].median()), end_p90=pct(g[:, 2].tolist(), 0.9), end_max=float(g[:, 2].max()))
    out["rec"] = dict(n=int(rec.shape[0]), start_min=float(rec[:, 0].min()), start_max=float(rec[:, 0].max()),
                      ready_min=float(rec[:, 1].min()), ready_max=float(rec[:, 1].max()),
                      chain_end_med=float(rec[:, 2].median()), chain_end_max=float(rec[:, 2].max()),
                      end_max=float(rec[:, 3].max()))
    out["raw_mid"] = mid.tolist()
    out["raw_rec"] = rec.tolist()
    return out


def regs() -> list[str]:
    """Registers, spills and warps of every compiled k1_rec build (its shape and layout constexprs):
    at 4 warps a program of more than 168 registers leaves fewer than 3 programs per SM."""
    from fast.triton import _k1

    fn = _k1.k1_rec_kernel
    names = ("L", "NV", "BV", "GT", "FLAT", "LEAN", "HOIST", "PRE", "TL")
    out = []
    for caches in getattr(fn, "device_caches", {}).values():
        for k in caches[0].values():
            k._init_handles()
            cx = getattr(k.src, "constants", {}) or {}
            by = {fn.arg_names[i[0]]: v for i, v in cx.items() if isinstance(i, tuple) and len(i) == 1}
            out.append(f"k1_rec {' '.join(f'{n}={by[n]}' for n in names if n in by)}: regs {k.n_regs}, "
                       f"spills {k.n_spills}, warps {k.metadata.num_warps}")
    return sorted(out)


def worst(row) -> float:
    """A variant's largest K1 time over its floor across the cases (inf if any check failed)."""
    cs = list(row["cases"].values())
    if not cs or any(c["bad"] for c in cs):
        return float("inf")
    return max(c["us"] / c["floor"] for c in cs)


def best(table, margin: float = 0.01) -> dict:
    """The variant with the smallest worst ratio, if it beats the defaults' (table[0]) by margin
    (0.01x: half a microsecond at 4x4 on the H200, the run-to-run spread); else {} (the defaults)."""
    win = min(table[1:], key=worst, default=None)
    return dict(win["variant"]) if win is not None and worst(win) < worst(table[0]) - margin else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1x1,4x1,4x4,8x1,8x4")
    ap.add_argument("--variants", default="", help="';'-separated TUNE overrides 'k=v,k=v' (the defaults first)")
    ap.add_argument("--timeline", default="", help="cases to record the per-program timeline of (NVIDIA)")
    ap.add_argument("--tl-variants", default="", help="';'-separated variants recorded too (the defaults always)")
    ap.add_argument("--rot", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every (variant, case) this many times, the variants in turn within a case and their "
                         "order rotated per round; the table has the median (clock drift falls on all alike)")
    ap.add_argument("--json", default="")
    ap.add_argument("--best", default="", help="write the winning variant 'k=v,...' here (empty: the defaults)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        print(f"bench_k1: --rounds {a.rounds}: want >= 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_k1: needs a CUDA/ROCm device", file=sys.stderr)
        return 2
    from fast.triton import BACKEND
    from fast.triton.tuning import ROWS, TUNE, parse_knobs

    try:
        bf.adopt_env()
        variants = [{}] + [parse_knobs(v, "--variants") for v in a.variants.split(";") if v.strip()]
        tvars = [{}] + [parse_knobs(v, "--tl-variants") for v in a.tl_variants.split(";") if v.strip()]
    except ValueError as e:
        print(f"bench_k1: {e}", file=sys.stderr)
        return 2
    base = dict(TUNE, _rows={m: dict(o) for m, o in ROWS.items()})
    cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",") if c]
    tcases = [tuple(int(x) for x in c.split("x")) for c in a.timeline.split(",") if c]
    cfg = rcfg.get_config("k3-tp8")
    dev = "cuda"
    bf.log(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {BACKEND.version}")
    jobs = [(dict(base, **v), cases) for v in variants] + [(dict(base, **v, stamps=True), tcases) for v in tvars
                                                            if tcases]
    bf.precompile(jobs, "mxfp4", 16)
    w1 = synth.k1_weights(cfg, bf.LAYER, 0, device=dev)
    w2 = synth.k2_weights(cfg, bf.LAYER, 0, "mxfp4", device=dev)
    rot = [(w1, w2)] + [({k: v.clone() for k, v in w1.items()}, w2) for _ in range(a.rot - 1)]
    bw, _ = bf.bandwidth(dev)
    bf.log(f"bandwidth: sum {bw:.0f} GB/s")
    res = dict(bw=bw, variants=[], timeline={})
    table = []
    by_case = {}
    for v in variants:
        bf.use(dict(base, **v))
        row = dict(variant=v, cases={})
        for S, L in cases:
            sets = [bf.make_case(cfg, S, L, "mxfp4", dev, w1_, w2_, seed=i) for i, (w1_, w2_) in enumerate(rot)]
            chk = bf.check_k1(BACKEND, sets[0][0], sets[0][1])
            bad = [c["name"] for c in chk if not c["ok"]] + BACKEND.health()
            fns = [lambda s=s: BACKEND.kda_pre(s[0], **s[1]) for s in sets]
            by_case[S, L] = fns
            t = bf.graph_time(fns)
            per = []
            for i in range(2):
                with bf.Only([i]) as o:
                    per.append(bf.graph_time([lambda f=f: (o.reset(), f()) for f in fns], reps=15))
            bad += BACKEND.health()
            floor = sum(bf.k1_floor(sets[0][0], sets[0][1], cfg)) / bw / 1e3
            row["cases"][f"{S}x{L}"] = dict(us=t, floor=floor, launches=per, bad=bad, rounds=[t])
            bf.log(f"  {v or 'defaults'} {S}x{L}: K1 {t:.1f} µs ({t / floor:.2f}x floor {floor:.1f}), "
                   f"alone {per[0]:.1f} + {per[1]:.1f}" + (f"  BAD {bad}" if bad else ""))
        res["variants"].append(row)
        table.append(row)
    for r in range(1, a.rounds):
        for S, L in cases:
            for i in [(i + r) % len(variants) for i in range(len(variants))]:
                bf.use(dict(base, **variants[i]))
                c = table[i]["cases"][f"{S}x{L}"]
                c["rounds"].append(bf.graph_time(by_case[S, L]))
                c["bad"] += BACKEND.health()
    if a.rounds > 1:
        for row in table:
            for k, c in row["cases"].items():
                c["us"] = statistics.median(c["rounds"])
                bf.log(f"  {row['variant'] or 'defaults'} {k}: rounds " + " ".join(f"{x:.1f}" for x in c["rounds"])
                       + f", median {c['us']:.1f} µs")
    for v in tvars:
        for S, L in tcases:
            bf.use(dict(base, **v, stamps=True))
            sets = [bf.make_case(cfg, S, L, "mxfp4", dev, w1, w2)]
            tl_ = timeline(BACKEND, sets, sets[0][0])
            name = ",".join(f"{k}={x}" for k, x in v.items()) or "defaults"
            res["timeline"][f"{name} {S}x{L}"] = tl_
            bf.log(f"timeline {name} {S}x{L} (µs from k1_mid's first program):")
            for k in [k for k in ("ares_A", "ares_B", "ares_C", "gemv", "rec") if k in tl_]:
                bf.log(f"  {k}: " + ", ".join(f"{n} {x:.2f}" if isinstance(x, float) else f"{n} {x}"
                                              for n, x in tl_[k].items()))
    bf.use(base)
    hdr = "variant | " + " | ".join(f"{S}x{L} K1 µs (x floor) [mid+rec]" for S, L in cases)
    print(hdr)
    for row in table:
        cells = []
        for S, L in cases:
            c = row["cases"][f"{S}x{L}"]
            cells.append(f"{c['us']:.1f} ({c['us'] / c['floor']:.2f}) [{c['launches'][0]:.1f}+{c['launches'][1]:.1f}]"
                         + (" BAD" if c["bad"] else ""))
        print(f"{row['variant'] or 'defaults'} | " + " | ".join(cells))
    print(f"floor basis: torch.sum {bw:.0f} GB/s")
    try:
        res["regs"] = regs()
    except Exception as e:  # a report of the Triton build, not a result: its absence must not sink the timings
        res["regs"] = [f"k1_rec registers unavailable: {type(e).__name__}: {e}"]
    print("\n".join(res["regs"]))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    if a.best:
        win = best(table)
        Path(a.best).write_text(",".join(f"{k}={int(v)}" for k, v in win.items()) + "\n")
        print(f"best: {win or 'defaults'}")
    return 1 if any(c["bad"] for r in table for c in r["cases"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
