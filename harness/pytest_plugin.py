"""pytest plugin (entry point `pytest11`): replay tests parametrized over a folder of
captures and the backends under test, one GPU per xdist worker, the markers of DESIGN §10,
seeds from test ids.

    pytest -n 8 [--captures DIR] [--backend auto|ref|triton|flydsl|pkg.mod:obj] [--policy FILE]

`--backend auto` (the default) tests the fused backends this node can run: Triton on a CUDA
node, Triton and FlyDSL on a ROCm node, the reference itself on a machine with no GPU (the
Triton interpret tier covers the twin there). `--captures` defaults to the golden set.

Fixtures: `capture_set` (one capture-set folder per test id), `k3_backend` (the backend spec
of this test; skips with the backend's reason when it is not available here, e.g. "no ROCm
device"), `k3_policy`, `k3_device`, `k3_seed` (from the test id), `k3_replay` (replays one
capture set, chained and isolated, with the test's seed and the backend under --k3-timeout,
and returns the judged results.Run).

Bad options are usage errors (pytest exit code 4), never a green skip: a --captures folder
that does not exist or holds no capture sets, a --backend that cannot be loaded.
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
GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "set"


def pytest_addoption(parser):
    g = parser.getgroup("k3verify")
    g.addoption("--captures", default=None, help="folder of capture sets to parametrize replay tests over "
                                                 "(default: the golden set)")
    g.addoption("--backend", default="auto", help="backend(s) under test, comma-separated: auto (the fused backends "
                                                  "of this node; the reference on a CPU-only machine) | ref | triton | "
                                                  "flydsl | package.module:object")
    g.addoption("--policy", default=None, help="tolerance policy TOML (default golden/tolerances.toml)")
    g.addoption("--k3-device", default=None, help="torch device for replays (default: cuda if present, else cpu)")
    g.addoption("--k3-timeout", default=None, type=float,
                help="seconds a backend may take per capture set (default 600): a hung backend fails its test "
                     "by the limit and the xdist node goes on")


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
    config._k3_backends = backend_specs(config.getoption("--backend"))
    opt = config.getoption("--captures")
    config._k3_captures = capture_root(opt) if opt else None


def auto_backends() -> list[str]:
    """The fused backends a node can run, found without starting a device runtime early."""
    if not gpu_ids():
        return ["ref"]
    if glob.glob("/sys/class/kfd/kfd/topology/nodes/*/gpu_id") and not glob.glob("/proc/driver/nvidia/gpus/*"):
        return ["triton", "flydsl"]
    return ["triton"]


def backend_specs(opt: str) -> list[str]:
    """--backend value -> backend specs; a spec that cannot be loaded is a usage error."""
    from fast import BackendError, load_backend

    specs = auto_backends() if opt == "auto" else [x.strip() for x in opt.split(",") if x.strip()]
    if not specs:
        raise pytest.UsageError(f"--backend: {opt!r} names no backend")
    for spec in specs:
        try:
            load_backend(spec)
        except BackendError as e:
            raise pytest.UsageError(f"--backend: {str(e).split(': ', 1)[-1]}") from None
    return specs


def capture_root(opt: str) -> Path:
    """--captures value -> folder; missing or empty is a usage error."""
    from .capture import discover
    from .errors import InputError

    root = Path(opt)
    if not root.exists():
        raise pytest.UsageError(f"--captures: {root} does not exist")
    try:
        found = discover(root)
    except InputError as e:
        raise pytest.UsageError(f"--captures: {e}") from None
    if not found:
        raise pytest.UsageError(f"--captures: no capture sets under {root}")
    return root


def seed_of(nodeid: str) -> int:
    return int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:4], "little")


def pytest_generate_tests(metafunc):
    if "capture_set" not in metafunc.fixturenames:
        return
    from .capture import discover

    cfg = metafunc.config
    root = getattr(cfg, "_k3_captures", None) or GOLDEN
    paths = discover(root)
    if not paths:  # the golden set itself is missing: a broken checkout, not a skip
        raise pytest.UsageError(f"no capture sets under {root} (run `k3verify golden regen`)")
    metafunc.parametrize("capture_set", paths, ids=[_test_id(p, root) for p in paths])
    if "k3_backend" in metafunc.fixturenames:
        specs = getattr(cfg, "_k3_backends", None) or ["ref"]
        metafunc.parametrize("k3_backend", specs, ids=[f"backend={s}" for s in specs], indirect=True)


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
    """The backend spec under test (parametrized by --backend); skips only when the backend is
    unavailable here for a stated reason."""
    from fast import available, load_backend

    spec = getattr(request, "param", None) or (getattr(request.config, "_k3_backends", None) or ["ref"])[0]
    ok, why = available(load_backend(spec))
    if not ok:
        pytest.skip(f"backend {spec}: {why}")
    return spec


@pytest.fixture
def k3_policy(request):
    return request.config.getoption("--policy")


@pytest.fixture
def k3_replay(request, k3_backend, k3_policy, k3_device, k3_seed):
    """replay(capture_set, **kw) -> results.Run through the test's backend, both views, poisons
    seeded by the test id, the backend under the time limit (--k3-timeout)."""
    from .engine import DEFAULT_TIMEOUT
    from .replay import replay

    timeout = request.config.getoption("--k3-timeout") or DEFAULT_TIMEOUT

    def run(capture_set, **kw):
        kw.setdefault("seed", k3_seed)
        kw.setdefault("timeout", timeout)
        return replay([capture_set], k3_backend, k3_device, k3_policy, progress=False, **kw)

    return run
