"""How fast K1's in_proj weight stream can go (issue L): the k1_mid in_proj items' access pattern
alone, over the weights as stored (row-major [NP, H]: each K step of an item reads BN rows of
BK·2 bytes, H·2 bytes apart) and over the same bytes packed tile-major ([NP/BN, H/BK, BN, BK]:
each K step one contiguous BN·BK·2-byte block), against a torch.sum over 4 GiB in the same run.

    PYTHONPATH=. python benchmarks/bench_stream.py [--config k3-tp8] [--rows 8] [--json F]

Every variant runs the gemv loop of the kernel (x @ w^T by MMA, K split in two, BN = 32,
stagger as TUNE) on a grid of cdiv(NP, BN)·split programs, one launch per weight copy (NROT copies
rotated past L2), timed under CUDA-graph replay. Both layouts must give the same sums (checked).
If the packed stream is clearly faster, the item layout is what keeps in_proj from the floor.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fast.triton._jit import mma  # noqa: E402
from ref import config as rcfg  # noqa: E402


@triton.jit
def stream_kernel(x_ptr, w_ptr, out_ptr, S, N, K, BN: tl.constexpr, BK: tl.constexpr, SP: tl.constexpr,
                  SPLIT: tl.constexpr, STAG: tl.constexpr, PACKED: tl.constexpr):
    """Grid (cdiv(N, BN)·SPLIT,): out[pid, :S, :BN] = x[:S, Ks] @ w[n0:n0+BN, Ks]^T (fp32)."""
    pid = tl.program_id(0)
    nb = pid // SPLIT
    ks = pid % SPLIT
    nk = K // BK // SPLIT
    koff = (pid * STAG) % nk
    rs = tl.arange(0, SP)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((SP, BN), dtype=tl.float32)
    for it in range(0, nk):
        kb = ks * nk + (it + koff) % nk
        x = tl.load(x_ptr + rs[:, None] * K + (kb * BK + rk)[None, :], mask=rs[:, None] < S, other=0.0)
        if PACKED:
            w = tl.load(w_ptr + ((nb * (K // BK) + kb) * BN + rn[:, None]).to(tl.int64) * BK + rk[None, :])
        else:
            w = tl.load(w_ptr + (nb * BN + rn[:, None]).to(tl.int64) * K + (kb * BK + rk)[None, :])
        acc = mma(x, tl.trans(w), acc)
    tl.store(out_ptr + (pid * SP + rs[:, None]) * BN + rn[None, :], acc)


def pack(w: torch.Tensor, BN: int, BK: int) -> torch.Tensor:
    N, K = w.shape
    return w.view(N // BN, BN, K // BK, BK).permute(0, 2, 1, 3).contiguous()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="k3-tp8")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--rot", type=int, default=3)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    import bench_fast as bf
    from fast.triton.tuning import TUNE

    cfg = rcfg.get_config(a.config)
    dev = "cuda"
    N, K, S = cfg.nproj // 32 * 32, cfg.hidden, a.rows
    bw, _ = bf.bandwidth(dev)
    print(f"device: {torch.cuda.get_device_name()}; w [{N}, {K}] bf16 ({N * K * 2 / 1e6:.1f} MB), {S} rows; "
          f"torch.sum {bw:.0f} GB/s", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    ws = [torch.randn(N, K, device=dev, generator=g).to(torch.bfloat16) for _ in range(a.rot)]
    x = torch.randn(S, K, device=dev, generator=g).to(torch.bfloat16)
    rows = []
    for BK, stages, warps, split in ((128, 6, 2, 2), (256, 4, 2, 2), (128, 6, 4, 2), (128, 6, 2, 1), (256, 3, 4, 1)):
        SP = max(16, triton.next_power_of_2(S))
        grid = (N // 32 * split,)
        res = {}
        for packed in (False, True):
            src = [pack(w, 32, BK) if packed else w for w in ws]
            outs = [torch.empty(grid[0], SP, 32, device=dev) for _ in src]
            fns = [lambda w=w, o=o: stream_kernel[grid](x, w, o, S, N, K, BN=32, BK=BK, SP=SP, SPLIT=split,
                                                         STAG=TUNE["stag"], PACKED=packed, num_warps=warps,
                                                         num_stages=stages) for w, o in zip(src, outs)]
            us = bf.graph_time(fns)
            res[packed] = (us, outs[0].clone())
            del src
        same = torch.equal(res[False][1], res[True][1])
        row = dict(BK=BK, stages=stages, warps=warps, split=split, rowmajor_us=res[False][0], packed_us=res[True][0],
                   rowmajor_gbs=N * K * 2 / res[False][0] / 1e3, packed_gbs=N * K * 2 / res[True][0] / 1e3, same=same)
        rows.append(row)
        print(f"BK={BK} stages={stages} warps={warps} split={split}: row-major {row['rowmajor_us']:.1f} µs "
              f"({row['rowmajor_gbs']:.0f} GB/s, {row['rowmajor_gbs'] / bw:.2f} of sum), packed "
              f"{row['packed_us']:.1f} µs ({row['packed_gbs']:.0f} GB/s, {row['packed_gbs'] / bw:.2f}); "
              f"same sums: {same}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), sum_gbs=bw, rows=rows), indent=1))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
