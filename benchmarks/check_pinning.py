"""Run `pytest -n N --dist each` on the GPU-pinning test and check that every worker
saw a different single GPU (from inside the test, after the device runtime started).

    python benchmarks/check_pinning.py [-n N]
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=len(glob.glob("/proc/driver/nvidia/gpus/*")) or 1)
    a = ap.parse_args()
    log = Path(tempfile.mkdtemp(prefix="k3-pin-"))
    env = dict(os.environ, K3VERIFY_GPU_LOG=str(log))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(a.n), "--dist", "each",
           "tests/test_multi_gpu.py", "-k", "worker_sees_own_gpu"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    print(r.stdout[-2000:], r.stderr[-2000:])
    recs = [json.loads(p.read_text()) for p in sorted(log.glob("*.json"))]
    for rec in recs:
        print(f"{rec['worker']}: pinned {rec['pinned']} visible {rec['visible']} {rec['name']} {rec['pci_bus']} "
              f"{rec['uuid']}")
    ids = [rec["uuid"] or rec["pci_bus"] for rec in recs]
    ok = r.returncode == 0 and len(recs) == a.n and len(set(ids)) == len(ids)
    print(f"{len(recs)} workers, {len(set(ids))} distinct GPUs: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
