"""K2's three reductions through torch.distributed across real processes (NCCL on GPUs,
gloo on CPUs) against the simulated world, and their time per step.

One process per rank (torch.multiprocessing). Each runs the capture set's K1 and K2
for its rank through the reference and, if asked, a fused backend, with
`ref.comm.DistComm`; outputs come back as safetensors files. The parent replays the
same set in one process through `SimWorld` and checks: `out` bit-identical on every
rank, NCCL == simulated bit for bit (both sum in rank order), and the default policy.

    python benchmarks/multi_gpu.py --captures DIR [--backends ref,triton] [--dist nccl|gloo]
    python benchmarks/multi_gpu.py --synth k3-tp8 --world 8      # make the set for that world first

Keep NVLink multicast off (NCCL_NVLS_ENABLE=0): the lent machines require it.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


class TimedComm:
    """Wraps a comm; times each all_reduce (device-synchronized) into `times`."""

    def __init__(self, comm, device):
        self.comm, self.world, self.device, self.times = comm, comm.world, device, []

    def all_reduce(self, x, rank):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        y = self.comm.all_reduce(x, rank)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - t)
        return y


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, set_path, backends, dist_backend, outdir, repeats):
    import torch.distributed as dist
    from safetensors.torch import save_file

    import ref
    from fast import load_backend
    from harness.capture import load_set
    from harness.engine import chain_k2

    device = f"cuda:{rank}" if dist_backend == "nccl" else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
    dist.init_process_group(dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cs = load_set(set_path)
    comm = TimedComm(ref.DistComm(), device)
    report = {"rank": rank, "device": torch.cuda.get_device_name(rank) if device.startswith("cuda") else "cpu"}
    tensors = {}
    for spec in backends:
        b = load_backend(spec)
        comm.times.clear()
        wall = []
        for it in range(repeats):
            k1 = None
            if cs.kind == "kda":
                k1 = cs.k1_args(rank, device, poison=False)
                b.kda_pre(cs.k1_key, **k1)
            k2 = chain_k2(None if k1 is None else [k1], [cs.k2_args(rank, device, poison=False)])[0]
            dist.barrier()
            t = time.perf_counter()
            b.k2_launch(cs.k2_key, **k2, rank=rank, comm=comm)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            wall.append(time.perf_counter() - t)
        tensors[f"{spec}.out"] = k2["out"].cpu()
        tensors[f"{spec}.prefix"] = k2["prefix"].cpu()
        per_step = [sum(comm.times[i * 3:(i + 1) * 3]) for i in range(repeats)]
        report[spec] = {"k2_wall_ms": statistics.median(wall[1:] or wall) * 1e3,
                        "reductions_ms": statistics.median(per_step[1:] or per_step) * 1e3}
    save_file(tensors, str(Path(outdir) / f"rank{rank}.safetensors"))
    (Path(outdir) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def simulated(set_path, spec, device, repeats):
    """The same set in one process through SimWorld; returns (outs, prefixes, reduction ms per step)."""
    import ref
    from fast import load_backend
    from harness.capture import load_set
    from harness.engine import chain_k2

    from ref.comm import ordered_sum

    cs = load_set(set_path)
    b = load_backend(spec)
    timings = []
    S, H, LAT = cs.k2_key.tokens, cs.cfg.hidden, cs.cfg.lat
    for _ in range(repeats):  # SimWorld's own work per step: three rank-order sums (barrier waits excluded)
        parts = [[torch.randn(S, n, device=device).to(torch.bfloat16) for _ in range(cs.world)] for n in (H, LAT, H)]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        for p in parts:
            ordered_sum(p).to(torch.bfloat16)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - t)
    for _ in range(1):
        k1 = None
        if cs.kind == "kda":
            k1 = [cs.k1_args(r, device, poison=False) for r in cs.ranks]
            for a in k1:
                b.kda_pre(cs.k1_key, **a)
        k2 = chain_k2(k1, cs.k2_world_args(device))
        ref.k2_world(cs.k2_key, k2, launch=b.k2_launch)
    return [a["out"].cpu() for a in k2], [a["prefix"].cpu() for a in k2], statistics.median(timings) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--captures", help="a capture-set folder (or a folder of sets: the first is used)")
    ap.add_argument("--synth", help="config to synthesize a set for --world (e.g. k3-tp8)")
    ap.add_argument("--world", type=int, help="processes (default: the set's world)")
    ap.add_argument("--experts", default="mxfp4")
    ap.add_argument("--backends", default="ref", help="comma list, e.g. ref,triton")
    ap.add_argument("--dist", default="nccl" if torch.cuda.device_count() > 1 else "gloo")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from safetensors.torch import load_file

    from harness.capture import discover, load_set
    from harness.metrics import compare
    from harness.policy import judge, load_policy, passed

    if a.synth:
        from harness.synth import synthesize

        root = Path(tempfile.mkdtemp(prefix="k3-mgpu-"))
        synthesize(a.synth, layers=[1], steps=1, num_spec=3, experts=a.experts, seed=0, out=root,
                   world=a.world, requests=1, device="cuda" if torch.cuda.is_available() else "cpu")
        a.captures = str(root)
    if not a.captures:
        ap.error("--captures or --synth is required")
    sets = discover(Path(a.captures)) or [Path(a.captures)]
    set_path = sets[0]
    cs = load_set(set_path)
    world = cs.world
    if a.world and a.world != world:
        ap.error(f"--world {a.world} but the set was made for world {world}")
    if a.dist == "nccl" and torch.cuda.device_count() < world:
        print(f"multi_gpu: needs {world} GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    backends = a.backends.split(",")
    out = Path(tempfile.mkdtemp(prefix="k3-mgpu-out-"))
    port = _free_port()
    torch.multiprocessing.spawn(_worker, args=(world, port, str(set_path), backends, a.dist, str(out), a.repeats),
                                nprocs=world, join=True)
    per_rank = [load_file(str(out / f"rank{r}.safetensors")) for r in range(world)]
    reps = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    policy = load_policy()
    dev0 = "cuda:0" if a.dist == "nccl" else "cpu"
    result = {"set": str(set_path), "world": world, "dist": a.dist, "devices": [r["device"] for r in reps],
              "backends": {}}
    ok = True
    for spec in backends:
        outs = [t[f"{spec}.out"] for t in per_rank]
        ranks_equal = all(torch.equal(outs[0], o) for o in outs[1:])
        sim_out, _, sim_ms = simulated(set_path, spec, dev0, a.repeats)
        bit_equal = all(torch.equal(o, s) for o, s in zip(outs, sim_out))
        m = compare(outs[0], sim_out[0], "out", **policy.compare_kw("k2", "out", cs.fmt))
        crit = judge(policy, "k2", "out", cs.fmt, m)
        dist_ms = statistics.median(r[spec]["reductions_ms"] for r in reps)
        result["backends"][spec] = {"ranks_bit_identical": ranks_equal, "dist_equals_simulated_bitwise": bit_equal,
                                    "policy_pass": passed(crit), "rel_l2_vs_simulated": m["rel_l2"],
                                    "reductions_ms_per_step": {"dist": dist_ms, "simulated": sim_ms},
                                    "k2_wall_ms_rank0": reps[0][spec]["k2_wall_ms"]}
        ok &= ranks_equal and passed(crit)
        print(f"{spec:8s} world {world} {a.dist}: out identical on every rank {ranks_equal}; "
              f"== simulated bitwise {bit_equal}; policy {'PASS' if passed(crit) else 'FAIL'}; "
              f"reductions per step {dist_ms:.3f} ms ({a.dist}) vs {sim_ms:.3f} ms (simulated)")
    print(json.dumps(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
