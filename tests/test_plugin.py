"""The pytest plugin's GPU pinning and seeds (DESIGN §10), without a GPU."""
import pytest
import torch

from harness import pytest_plugin as pp

pytest_plugins = ["pytester"]

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("worker,visible,want", [
    ("gw0", "0,1,2,3", "0"), ("gw3", "0,1,2,3", "3"), ("gw5", "0,1,2,3", "1"), ("gw1", "4,6", "6"),
])
def test_worker_gets_its_own_gpu(worker, visible, want):
    env = {"PYTEST_XDIST_WORKER": worker, "CUDA_VISIBLE_DEVICES": visible}
    assert pp.pin_worker_gpu(env) == want
    assert env["CUDA_VISIBLE_DEVICES"] == want and env["HIP_VISIBLE_DEVICES"] == want
    assert pp.pin_worker_gpu(env) == want  # idempotent: a second hook call keeps the pin


def test_eight_workers_on_eight_gpus_are_distinct():
    pins = [pp.pin_worker_gpu({"PYTEST_XDIST_WORKER": f"gw{i}", "HIP_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
            for i in range(8)]
    assert sorted(pins) == [str(i) for i in range(8)]


def test_no_worker_or_no_gpu_leaves_env_alone():
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert pp.pin_worker_gpu(env) is None and env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    env = {"PYTEST_XDIST_WORKER": "gw2", "CUDA_VISIBLE_DEVICES": ""}
    assert pp.pin_worker_gpu(env) is None


def test_seed_derives_from_test_id(request, k3_seed):
    assert k3_seed == pp.seed_of(request.node.nodeid)
    assert pp.seed_of("a::b") != pp.seed_of("a::c")


def test_replay_seed_comes_from_the_test_id(request, k3_replay, monkeypatch):
    """k3_replay seeds the poisons with the test id's seed (set i gets seed + i)."""
    from harness import replay as rp

    seen = []
    real = rp.run_step
    monkeypatch.setattr(rp, "run_step", lambda *a, **kw: (seen.append(kw["seed"]), real(*a, **kw))[1])
    from harness.capture import discover

    k3_replay(discover(pp.GOLDEN)[0])
    assert seen == [pp.seed_of(request.node.nodeid)]


def test_poisons_differ_between_ids_and_repeat_for_one():
    """Two test ids poison the untouched memory differently; one id always the same way."""
    from harness import engine
    from harness.capture import discover, load_set

    cs = next(c for c in map(load_set, discover(pp.GOLDEN)) if c.has_k1)
    args = cs.k1_args(0)

    def poison(nodeid):
        a, _ = engine.prepare_k1(args, cs.k1_key, pp.seed_of(nodeid))
        return a["rstate"][-engine.EXTRA_SLOTS:], a["conv_state"][0]

    a1, a2, b = poison("t.py::a"), poison("t.py::a"), poison("t.py::b")
    assert all(torch.equal(x, y) for x, y in zip(a1, a2))
    assert not any(torch.equal(x, y) for x, y in zip(a1, b))


@pytest.mark.parametrize("args,msg", [
    (["--captures", "/nonexistent/k3"], "--captures: /nonexistent/k3 does not exist"),
    (["--backend", "tritn"], "--backend: 'tritn' is neither"),
])
def test_bad_options_are_usage_errors(pytester, args, msg):
    pytester.makepyfile("def test_x(capture_set, k3_replay):\n    pass\n")
    r = pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert msg in r.stderr.str()


def test_empty_captures_folder_is_a_usage_error(pytester, tmp_path):
    pytester.makepyfile("def test_x(capture_set, k3_replay):\n    pass\n")
    r = pytester.runpytest_subprocess("--captures", str(tmp_path), "-p", "no:cacheprovider")
    assert r.ret == pytest.ExitCode.USAGE_ERROR and "no capture sets under" in r.stderr.str()


def test_auto_backend_per_node(monkeypatch):
    """auto: the reference without a GPU, Triton on CUDA, Triton and FlyDSL on ROCm."""
    monkeypatch.setattr(pp, "gpu_ids", lambda env=None: [])
    assert pp.auto_backends() == ["ref"]
    monkeypatch.setattr(pp, "gpu_ids", lambda env=None: ["0"])
    nv = lambda pat: ["x"] if "nvidia" in pat else []  # noqa: E731
    monkeypatch.setattr(pp.glob, "glob", nv)
    assert pp.auto_backends() == ["triton"]
    monkeypatch.setattr(pp.glob, "glob", lambda pat: ["x"] if "kfd" in pat else [])
    assert pp.auto_backends() == ["triton", "flydsl"]


def test_ci_requires_the_flydsl_compile_tier(monkeypatch):
    """.ci/run sets K3VERIFY_REQUIRE_FLYDSL=1: a toolchain that cannot compile is a usage error."""
    import conftest
    from fast.flydsl import toolchain

    monkeypatch.setenv("K3VERIFY_REQUIRE_FLYDSL", "1")
    monkeypatch.setattr(toolchain, "compile_ready", lambda: (False, "ld.lld not found"))
    with pytest.raises(pytest.UsageError, match="ld.lld not found"):
        conftest.pytest_configure(None)
    monkeypatch.delenv("K3VERIFY_REQUIRE_FLYDSL")
    conftest.pytest_configure(None)  # not required: nothing to say
