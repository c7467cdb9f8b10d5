"""The pytest plugin's GPU pinning and seeds (DESIGN §10), without a GPU."""
import pytest

from harness import pytest_plugin as pp

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
