"""Measure how far the reference's isolated stages move between CPU code paths, the basis of
the golden check's tolerance (harness/golden.py ISO_*):

    .venv/bin/python scripts/golden_spread.py

Runs `golden check` (isolated) once per code path — MKL_CBWR=AVX512|AVX2|SSE4_2|COMPATIBLE
and ATEN_CPU_CAPABILITY=avx512|avx2|default (those this CPU has) — in a fresh process each, and
prints per dtype and stage the largest fraction of elements that differ and the largest error
in ulps (harness.golden.stage_spread), against the limits the check applies.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

MODES = [{"MKL_CBWR": m} for m in ("AVX512", "AVX2", "SSE4_2", "COMPATIBLE")] + \
        [{"ATEN_CPU_CAPABILITY": c} for c in ("avx512", "avx2", "default")] + \
        [{"MKL_CBWR": "SSE4_2", "ATEN_CPU_CAPABILITY": "default"}]

CHILD = r"""
import json, sys
from harness import golden
golden.SPREADS = []
problems = golden.check()
print(json.dumps({"problems": problems, "spreads": golden.SPREADS}))
"""


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    worst: dict = {}
    failed = 0
    for env in MODES:
        r = subprocess.run([sys.executable, "-c", CHILD], cwd=root, env={**os.environ, **env, "PYTHONPATH": root},
                           capture_output=True, text=True)
        label = " ".join(f"{k}={v}" for k, v in env.items())
        if r.returncode:
            print(f"{label}: failed\n{r.stderr[-2000:]}")
            failed += 1
            continue
        doc = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{label}: {len(doc['problems'])} problem(s) " + "; ".join(doc["problems"][:3]))
        failed += bool(doc["problems"])
        for name, sp in doc["spreads"]:
            stage = name.split(" ")[1].split(".", 1)[-1]
            w = worst.setdefault((sp["dtype"], stage), [0.0, 0.0, ""])
            if sp["frac"] > w[0]:
                w[0] = sp["frac"]
            if sp["ulps"] > w[1]:
                w[1], w[2] = sp["ulps"], label
    from harness import golden

    print(f"\n{'dtype':9} {'stage':16} {'max frac':>9} {'max ulps':>9}  worst on")
    for (dt, st), (fr, ul, where) in sorted(worst.items()):
        print(f"{dt:9} {st:16} {fr:9.4f} {ul:9.3g}  {where}")
    print(f"\nlimits: bf16 {golden.ISO_BF16_ULPS:g} ulp in <= {golden.ISO_BF16_FRAC:.0%} of elements; fp32 "
          f"{golden.ISO_F32_ULPS:g} ulps of max(|x|, rms)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
