"""pytest plugin (entry point `pytest11`): replay tests parametrized over a folder of
captures, one GPU per xdist worker, the markers of DESIGN §10, seeds from test ids.

    pytest -n 8 --captures golden/ [--backend triton] [--policy FILE]

Fixtures: `capture_set` (one capture-set folder per test id), `k3_backend` (skips with
the backend's reason when it is not available), `k3_policy`, `k3_device`, `k3_seed`,
`k3_replay` (replays one capture set and returns the judged results.Run).
"""
from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path

import pytest

MARKERS = {
    "cpu": "reference, harness, formats, reports (no accelerator)",
    "interpret": "Triton backend under TRITON_INTERPRET=1 on the CPU, tiny config",
    "flydsl_compile": "FlyDSL builds compiled for gfx942/gfx950 without running",
    "gpu": "needs a CUDA or ROCm device",
    "rocm": "FlyDSL execution on a ROCm device",
    "multi_gpu": "needs several GPUs",
    "slow": "takes more than a few seconds",
}
GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def pytest_addoption(parser):
    g = parser.getgroup("k3verify")
    g.addoption("--captures", default=None, help="folder of capture sets to parametrize replay tests over "
                                                 "(default: the golden set)")
    g.addoption("--backend", default="ref", help="backend under test: ref | triton | flydsl | package.module:object")
    g.addoption("--policy", default=None, help="tolerance policy TOML (default golden/tolerances.toml)")
    g.addoption("--k3-device", default=None, help="torch device for replays (default: cuda if present, else cpu)")


def gpu_ids(env=os.environ) -> list[str]:
    """GPUs this process may use, found without starting a device runtime."""
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        v = env.get(var)
        if v is not None:
            return [x for x in v.split(",") if x.strip() != ""]
    nv = glob.glob("/proc/driver/nvidia/gpus/*")
    if nv:
        return [str(i) for i in range(len(nv))]
    n = 0
    for p in glob.glob("/sys/class/kfd/kfd/topology/nodes/*/gpu_id"):
        try:
            n += Path(p).read_text().strip() not in ("", "0")
        except OSError:
            pass
    return [str(i) for i in range(n)]


def pin_worker_gpu(env=os.environ) -> str | None:
    """Give xdist worker gwN the N-th visible GPU (mod count), before any device runtime starts."""
    worker = env.get("PYTEST_XDIST_WORKER")
    if not worker or env.get("K3VERIFY_NO_PIN"):
        return None
    if env.get("K3VERIFY_PINNED_GPU") is not None:
        return env["K3VERIFY_PINNED_GPU"]
    ids = gpu_ids(env)
    if not ids:
        return None
    gpu = ids[int(worker.lstrip("gw") or 0) % len(ids)]
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        env[var] = gpu
    env["K3VERIFY_PINNED_GPU"] = gpu
    return gpu


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    pin_worker_gpu()  # before any conftest can import torch and start the device runtime


def pytest_configure(config):
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    pin_worker_gpu()


def seed_of(nodeid: str) -> int:
    return int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:4], "little")


def _capture_ids(root: Path) -> list[Path]:
    from .capture import discover

    return discover(root) if root.exists() else []


def pytest_generate_tests(metafunc):
    if "capture_set" not in metafunc.fixturenames:
        return
    opt = metafunc.config.getoption("--captures")
    root = Path(opt) if opt else GOLDEN
    paths = _capture_ids(root)
    if not paths:
        metafunc.parametrize("capture_set", [pytest.param(None, marks=pytest.mark.skip(
            reason=f"no capture sets under {root}"))], ids=["no-captures"])
        return
    metafunc.parametrize("capture_set", paths, ids=[_test_id(p, root) for p in paths])


def _test_id(p: Path, root: Path) -> str:
    try:
        return str(p.relative_to(root)).replace(os.sep, "/")
    except ValueError:
        return p.name


@pytest.fixture
def k3_seed(request) -> int:
    return seed_of(request.node.nodeid)


@pytest.fixture
def k3_device(request) -> str:
    from .replay import resolve_device

    return resolve_device(request.config.getoption("--k3-device"))


@pytest.fixture
def k3_backend(request):
    from fast import BackendError, available, load_backend

    spec = request.config.getoption("--backend")
    try:
        b = load_backend(spec)
    except BackendError as e:
        pytest.skip(str(e))
    ok, why = available(b)
    if not ok:
        pytest.skip(f"backend {spec}: {why}")
    return spec


@pytest.fixture
def k3_policy(request):
    return request.config.getoption("--policy")


@pytest.fixture
def k3_replay(k3_backend, k3_policy, k3_device):
    from .replay import replay

    def run(capture_set, **kw):
        return replay([capture_set], k3_backend, k3_device, k3_policy, progress=False, **kw)

    return run
