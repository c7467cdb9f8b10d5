"""Several GPUs: NCCL reductions vs the simulated world, and one GPU per xdist worker.

    pytest -n <GPUs> --dist each -m gpu tests/test_multi_gpu.py -k worker   # with K3VERIFY_GPU_LOG=DIR
    python benchmarks/check_pinning.py                                      # runs the above, checks DIR
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.gpu
def test_worker_sees_own_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    torch.zeros(1, device="cuda")  # the device runtime has started
    props = torch.cuda.get_device_properties(0)
    rec = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "visible": torch.cuda.device_count(),
           "pinned": os.environ.get("K3VERIFY_PINNED_GPU"), "uuid": str(getattr(props, "uuid", "")),
           "pci_bus": getattr(props, "pci_bus_id", None), "name": props.name}
    log = Path(os.environ.get("K3VERIFY_GPU_LOG") or tmp_path)
    log.mkdir(parents=True, exist_ok=True)
    (log / f"{rec['worker']}.json").write_text(json.dumps(rec))  # one file per worker: no shared path
    if os.environ.get("PYTEST_XDIST_WORKER"):
        assert rec["visible"] == 1, "a pinned worker must see exactly one GPU"


@pytest.mark.multi_gpu
@pytest.mark.slow
def test_nccl_reductions_match_simulated_world():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip(f"needs 2 or more GPUs ({n} visible)")
    world = 8 if n >= 8 else 4 if n >= 4 else 2
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_gpu.py"), "--synth", "k3-tp8",
                        "--world", str(world), "--backends", "ref"], capture_output=True, text=True,
                       cwd=ROOT, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["backends"]["ref"]["ranks_bit_identical"]
    assert res["backends"]["ref"]["dist_equals_simulated_bitwise"]


@pytest.mark.cpu
def test_multi_process_gloo_matches_simulated_world(tmp_path):
    """The same script on CPUs: one gloo process per rank, bit-identical to SimWorld."""
    out = tmp_path / "res.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_gpu.py"), "--captures",
                        str(ROOT / "golden" / "set" / "int4-l2-3"), "--dist", "gloo", "--backends", "ref",
                        "--repeats", "1", "--json", str(out)], capture_output=True, text=True, cwd=ROOT,
                       timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())["backends"]["ref"]
    assert res["ranks_bit_identical"] and res["dist_equals_simulated_bitwise"] and res["policy_pass"]
