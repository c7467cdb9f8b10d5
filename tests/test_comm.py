"""K2's collective (DESIGN §5 K2, §6): rank-order fp32 sums, the simulated world, and two real
gloo processes whose k2_launch outputs are bit-identical to the simulated world.

Run as a script (`python tests/test_comm.py --worker ...`) this file is the gloo worker: it
rebuilds the seeded inputs itself and writes its outputs as safetensors."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import TINY, make_k2  # noqa: E402

import loops as lp  # noqa: E402
import ref  # noqa: E402
from ref.comm import DistComm, SimWorld, ordered_sum, run_world  # noqa: E402

pytestmark = pytest.mark.cpu

# (layer, expert format) of the launches each gloo worker runs, in order
GLOO_STEPS = ((2, "bf16"), (3, "mxfp4"))


def _seq_sum_f32(parts: list[np.ndarray], order) -> np.ndarray:
    acc = parts[order[0]].astype(np.float32).copy()
    for r in order[1:]:
        acc = (acc + parts[r].astype(np.float32)).astype(np.float32)
    return acc


def test_ordered_sum_rank_order():
    parts = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])]
    assert float(ordered_sum(parts)) == 0.0  # (1e8 + 1) rounds back to 1e8 in fp32
    assert float(ordered_sum(parts, [0, 2, 1])) == 1.0
    b = [torch.tensor([256.0], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.bfloat16),
         torch.tensor([-256.0], dtype=torch.bfloat16)]
    s = ordered_sum(b)
    assert s.dtype == torch.float32 and float(s) == 1.0, "bf16 parts must accumulate in fp32"
    d = ordered_sum([torch.tensor([1.0], dtype=torch.float64), torch.tensor([1e-20], dtype=torch.float64)])
    assert d.dtype == torch.float64 and float(d) == 1.0 + 1e-20


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_simworld_all_reduce(rng, world):
    xs = [(torch.randn(5, 7, generator=rng) * 10 ** float(r % 3)).to(torch.bfloat16) for r in range(world)]
    order = torch.randperm(world, generator=rng).tolist()
    for ordr in (None, order):
        comm = SimWorld(world, ordr)
        res = run_world(world, lambda r: comm.all_reduce(xs[r], r), comm)
        want = _seq_sum_f32([lp.f64(x) for x in xs], ordr or list(range(world)))
        for r in range(world):
            assert res[r].dtype == torch.float32
            np.testing.assert_array_equal(res[r].numpy(), want, err_msg=f"rank {r}, order {ordr}")
        assert comm.calls == 1


def test_simworld_rejects_bad_world_and_order():
    with pytest.raises(ValueError, match="world"):
        SimWorld(3)
    with pytest.raises(ValueError, match="order"):
        SimWorld(2, [0, 0])


def test_run_world_reraises_first_failure():
    comm = SimWorld(2, timeout=60)

    def fn(r):
        if r == 1:
            raise KeyError("rank 1 failed")
        return comm.all_reduce(torch.ones(2), r)  # would wait for rank 1 forever without the abort

    done = threading.Event()
    with pytest.raises(KeyError, match="rank 1 failed"):
        try:
            run_world(2, fn, comm)
        finally:
            done.set()
    assert done.is_set()


def test_simworld_repeated_calls(rng):
    """Three reductions in a row (as K2 makes) never mix up two calls' slots."""
    world = 4
    xs = [[torch.randn(3, generator=rng) for _ in range(3)] for _ in range(world)]
    comm = SimWorld(world)
    res = run_world(world, lambda r: [comm.all_reduce(xs[r][i], r) for i in range(3)], comm)
    for i in range(3):
        want = _seq_sum_f32([xs[r][i].numpy().astype(np.float64) for r in range(world)], list(range(world)))
        for r in range(world):
            np.testing.assert_array_equal(res[r][i].numpy(), want)
    assert comm.calls == 3


# ---------------------------------------------------------------- two gloo processes

def _worker(rank: int, world: int, init: str, seed: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        comm = DistComm()
        for layer, fmt in GLOO_STEPS:
            key, ranks = make_k2(TINY, seed, layer=layer, fmt=fmt)
            a, taps = ranks[rank], {}
            ref.k2_launch(key, **a, rank=rank, comm=comm, taps=taps)
            tensors = {"out": a["out"], "prefix": a["prefix"], **{f"tap.{k}": v.contiguous() for k, v in taps.items()}}
            save_file(tensors, os.path.join(out, f"{layer}-{fmt}-rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


def test_gloo_matches_simulated_world(tmp_path, seed):
    pytest.importorskip("torch.distributed")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    world = 2
    env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"), OMP_NUM_THREADS="1")
    init = tmp_path / "pg-init"
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(init), str(seed),
                               str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=180)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("gloo workers timed out")
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"gloo rank {r} failed:\n{logs[r][-3000:]}"
    # The workers run one BLAS thread each; the simulated world must too: on some CPUs
    # (seen on an AMD EPYC) MKL's fp32 GEMM splits K by thread count, moving the logits' last bit.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sims = []
        for layer, fmt in GLOO_STEPS:
            key, ranks = make_k2(TINY, seed, layer=layer, fmt=fmt)
            for a in ranks:
                a["taps"] = {}
            ref.k2_world(key, ranks)
            sims.append(ranks)
    finally:
        torch.set_num_threads(threads)
    for (layer, fmt), ranks in zip(GLOO_STEPS, sims):
        for r in range(world):
            got = load_file(str(tmp_path / f"{layer}-{fmt}-rank{r}.safetensors"))
            lp.assert_bits(f"{fmt} rank {r} out", got["out"], ranks[r]["out"])
            lp.assert_bits(f"{fmt} rank {r} prefix", got["prefix"], ranks[r]["prefix"])
            for k, v in ranks[r]["taps"].items():
                lp.assert_bits(f"{fmt} rank {r} tap {k}", got[f"tap.{k}"], v.contiguous())
        assert not torch.isnan(ranks[0]["out"]).any()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="gloo worker of test_gloo_matches_simulated_world")
    ap.add_argument("--worker", nargs=5, metavar=("RANK", "WORLD", "INIT", "SEED", "OUT"), required=True)
    r, w, i, s, o = ap.parse_args().worker
    _worker(int(r), int(w), i, int(s), o)
