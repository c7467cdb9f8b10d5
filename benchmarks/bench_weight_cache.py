"""Peak RSS of replaying 1 vs N capture sets of one layer (the per-process WeightCache shares
the layer's weights among them), each in a fresh process under /usr/bin/time -v.

    PYTHONPATH=. python benchmarks/bench_weight_cache.py [--config small] [--sets 6] [--weights recipe]

Makes a corpus of N steps of one layer (`synth --layers 1 --num-spec 1`), then measures:
- loader: load_set + the launch arguments + the reference's K1 and K2 on every rank, set by set
  (what harness.capture owns);
- replay: `k3verify replay --backend ref --no-isolate` (the whole harness: it holds the previous
  set's step while it loads the next, so its peak may hold two sets' state);
each with the cache on (default budget) and off (K3VERIFY_WEIGHT_CACHE=0).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

LOOP = """
import sys
from harness.capture import CACHE, discover, load_set
import ref
for p in discover(sys.argv[1])[:int(sys.argv[2])]:
    cs = load_set(p)
    k1 = [cs.k1_args(r) for r in cs.ranks] if cs.has_k1 else []
    for a in k1:
        ref.kda_pre(cs.k1_key, **a)
    if cs.has_k2:
        ref.k2_world(cs.k2_key, cs.k2_world_args())
    del cs, k1, a  # nothing of this set alive while the next one loads
print("cache", CACHE.hits, "hits", CACHE.misses, "misses", file=sys.stderr)
"""


def _peak(cmd, env) -> tuple[int, str]:
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    hits = re.search(r"cache (\d+) hits (\d+) misses", r.stderr)
    return kb, (f"{hits.group(1)} hits / {hits.group(2)} misses" if hits else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="small")
    p.add_argument("--sets", type=int, default=6)
    p.add_argument("--weights", default="recipe", choices=("recipe", "stored"))
    p.add_argument("--only", choices=("loader", "replay"), default=None)
    p.add_argument("--one-arena", action="store_true",
                   help="MALLOC_ARENA_MAX=1 MALLOC_TRIM_THRESHOLD_=0: separates glibc's per-thread arena "
                        "growth from memory the harness holds")
    a = p.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if a.one_arena:
        env.update(MALLOC_ARENA_MAX="1", MALLOC_TRIM_THRESHOLD_="0")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "c"
        subprocess.run([PY, "-m", "harness.cli", "synth", "--config", a.config, "--layers", "1", "--steps",
                        str(a.sets), "--num-spec", "1", "--weights", a.weights, "--no-git", "-q", "--out", str(out)],
                       cwd=ROOT, env=env, check=True)
        print(f"{a.config}, layer 1, {a.sets} steps, {a.weights} weights; peak RSS (MB), fresh process each:")
        for what in [a.only] if a.only else ("loader", "replay"):
            for cache in ("default", "0"):
                e = dict(env)
                if cache == "0":
                    e["K3VERIFY_WEIGHT_CACHE"] = "0"
                res = []
                for n in (1, a.sets):
                    if what == "loader":
                        cmd = [PY, "-c", LOOP, str(out), str(n)]
                    else:
                        cmd = [PY, "-m", "harness.cli", "replay", str(out), "--backend", "ref", "--device", "cpu",
                               "--no-isolate", "--quiet", "--limit", str(n), "--json", str(Path(d) / f"r{n}.json")]
                    res.append(_peak(cmd, e))
                (k1, _), (kn, hits) = res
                print(f"  {what:6s} cache={cache:7s}: 1 set {k1 / 1024:.0f}, {a.sets} sets {kn / 1024:.0f} "
                      f"-> {kn / k1:.3f}x {hits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
