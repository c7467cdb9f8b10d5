"""Shared fixtures of the reference tests: tiny launch inputs built from `ref.synth`, seeds
derived from the test id, and outputs poisoned before every launch.

The builders are plain functions (the two-process gloo test imports this file in its
workers); tests reach them through the factory fixtures `k1_case` / `k2_case`.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the suite runs from a checkout without an install
    sys.path.insert(0, str(ROOT))

from ref import config as rcfg  # noqa: E402
from ref import synth  # noqa: E402

BF16 = torch.bfloat16
TINY = rcfg.get_config("tiny")
# Global NH, RI, SI, hidden all divide by 8, and per-rank RI/SI stay multiples of 32 at world 8.
WIDE = dataclasses.replace(TINY, name="tiny-w8", world=1, nh=8, ri=256, si=256)


def seed_from(nodeid: str) -> int:
    return int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:4], "little") & 0x7FFFFFFF


def pytest_configure(config):
    """K3VERIFY_REQUIRE_FLYDSL=1 (set by .ci/run): the FlyDSL compile tier must run, so a missing
    flydsl or ld.lld is an error, not a skipped tier. K3VERIFY_TRITON_TUNE set is an error: it
    would override the knobs the Triton tests set themselves, and they would pass unchecked."""
    import os

    from fast.triton.tuning import ENV

    if os.environ.get(ENV):
        raise pytest.UsageError(f"{ENV} is set ({os.environ[ENV]!r}): the tests set the Triton knobs themselves; "
                                "unset it (it is for replays and benchmarks)")
    if os.environ.get("K3VERIFY_REQUIRE_FLYDSL") == "1":
        try:
            from fast.flydsl import toolchain

            ok, why = toolchain.compile_ready()
        except ImportError as e:
            ok, why = False, f"flydsl not importable ({e})"
        if not ok:
            raise pytest.UsageError(f"K3VERIFY_REQUIRE_FLYDSL=1 but the flydsl_compile tier cannot run: {why}")


@pytest.fixture
def seed(request) -> int:
    return seed_from(request.node.nodeid)


@pytest.fixture
def rng(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def clone(kw: dict) -> dict:
    """Deep copy of launch kwargs (tensors cloned with their strides, nested dicts copied)."""
    out = {}
    for k, v in kw.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype).copy_(v) if v.dim() else v.clone()
        elif isinstance(v, dict):
            out[k] = clone(v)
        else:
            out[k] = v
    return out


def make_k1(cfg=TINY, seed: int = 0, *, layer: int = 1, R: int = 3, L: int = 3, with_delta: bool = True,
            pad_every: int = 0, sl_extra: int = 0, spare: int = 3, rank: int = 0):
    """(KdaPreBuild, kwargs) of one K1 launch: S = R·L tokens, caches with `spare` slots no
    request references, state_len = W-2+L+sl_extra, core_out poisoned with NaN."""
    g = torch.Generator().manual_seed(seed)
    S = R * L
    w = synth.k1_weights(cfg, layer, rank, seed=seed)
    prefix, blocks, delta = synth.carry(cfg, S, layer, g, with_delta=with_delta)
    st_idx, num_acc, slots = synth.spec_indices(R, L, g, pad_every=pad_every)
    SL = cfg.conv - 2 + L + sl_extra
    conv_state, rstate = synth.caches(cfg, slots + spare, SL, g)
    core_out = torch.full((S, cfg.p), float("nan"), dtype=BF16)
    key = rcfg.k1_build(cfg, layer, S, L, with_delta, SL)
    kw = dict(prefix=prefix, delta=delta, blocks=blocks, **w, conv_state=conv_state, rstate=rstate,
              st_idx=st_idx, num_acc=num_acc, core_out=core_out, layer=layer)
    return key, kw


def global_core(cfg, S: int, seed: int) -> torch.Tensor:
    """[S, global P] o_proj input, drawn once for every world size (sliced per rank by heads)."""
    g = torch.Generator().manual_seed(seed ^ 0x5EED)
    return (torch.randn(S, cfg.nh * cfg.world * cfg.hd, generator=g) * 0.7).to(BF16)


def make_k2(cfg=TINY, seed: int = 0, *, layer: int = 1, fmt: str = "bf16", S: int = 6, topk: int | None = None):
    """(K2Build, [kwargs per rank]) of one K2 step over all cfg.world ranks; `out` poisoned with NaN.

    Weights come from ref.synth per unit and `core` from one global draw, so every world
    size of the same global model sees the same numbers.
    """
    g = torch.Generator().manual_seed(seed)
    prefix, blocks, _ = synth.carry(cfg, S, layer, g, with_delta=False)
    core = global_core(cfg, S, seed)
    P = cfg.p
    key = rcfg.k2_build(cfg, layer, S, fmt)
    if topk is not None:
        key = dataclasses.replace(key, topk=topk)
    ranks = []
    for r in range(cfg.world):
        w = synth.k2_weights(cfg, layer, r, fmt, seed=seed)
        ranks.append(dict(core=core[:, r * P:(r + 1) * P].contiguous(), prefix=prefix.clone(),
                          blocks=blocks.clone(), **w, out=torch.full((S, cfg.hidden), float("nan"), dtype=BF16),
                          layer=layer))
    return key, ranks


@pytest.fixture
def k1_case(seed):
    return functools.partial(make_k1, seed=seed)


@pytest.fixture
def k2_case(seed):
    return functools.partial(make_k2, seed=seed)
