"""Triton backend, interpreted: the one-launch rank-order reduction (fast.triton.comm) against
ref.comm.ordered_sum bit for bit, and a whole K2 world through DeviceWorld equal to SimWorld."""
from __future__ import annotations

import pytest
import torch

from triton_tier import backend, triton, tune  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import ref  # noqa: E402
from conftest import clone  # noqa: E402
from ref.comm import SimWorld, ordered_sum, run_world  # noqa: E402

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("world,order,dtype", [(2, None, torch.bfloat16), (4, (2, 0, 3, 1), torch.bfloat16),
                                                (8, None, torch.float32), (1, None, torch.bfloat16)])
def test_rank_sum_bit_exact(backend, rng, world, order, dtype):
    from fast.triton.comm import DeviceWorld

    shape = (3, 1500)  # more than one block, a ragged tail
    # magnitudes spread over 2^±12 so that the fp32 sum order shows in the bits
    parts = [(torch.randn(shape, generator=rng) * torch.exp2(torch.randint(-12, 12, shape, generator=rng).float()))
             .to(dtype) for _ in range(world)]
    parts[0][0, :8] = -0.0  # a -0 first rank: ordered_sum keeps it
    for p in parts[1:]:
        p[0, :8] = -0.0
    want = ordered_sum(parts, order)
    dw = DeviceWorld(world, order)
    got = run_world(world, lambda r: dw.all_reduce(parts[r], r), dw)
    for g in got:
        assert g.dtype == torch.float32 and torch.equal(g.view(torch.int32), want.view(torch.int32))
    if world > 2:  # the order matters in these bits: another order gives other bits somewhere
        other = ordered_sum(parts, list(reversed(order or range(world))))
        assert not torch.equal(other.view(torch.int32), want.view(torch.int32))


def test_k2_world_device_world_equals_sim_world(backend, tune, k2_case):
    from fast.triton.comm import DeviceWorld

    key, ranks = k2_case(fmt="mxfp4", layer=1, S=4)
    a = [dict(clone(r)) for r in ranks]
    b = [dict(clone(r)) for r in ranks]
    ref.k2_world(key, a, launch=backend.k2_launch, comm=SimWorld(len(ranks)))
    dw = DeviceWorld(len(ranks))
    ref.k2_world(key, b, launch=backend.k2_launch, comm=dw)
    assert dw.calls == 3
    for r in range(len(ranks)):
        assert torch.equal(b[r]["out"], a[r]["out"]) and torch.equal(b[r]["prefix"], a[r]["prefix"])
