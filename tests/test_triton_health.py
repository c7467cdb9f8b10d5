"""Triton backend, interpreted: health() (issue H, "a backend's health is part of the verdict").

A ticketed launch whose wait gives up computes on rows nobody wrote; the kernel raises its
overflow flag and health() must say so (then clear it). Forced here with a row counter left
one short and a tiny spin budget; a normal launch reports nothing, before and after.
"""
from __future__ import annotations

import pytest
import torch

from triton_tier import backend, triton, tune  # noqa: E402,F401  (sets TRITON_INTERPRET first)

import ref  # noqa: E402
from conftest import clone  # noqa: E402
from fast.triton import _host  # noqa: E402

pytestmark = pytest.mark.interpret


def _scratch(tag, key):
    return [v for k, v in _host._SCRATCH.items() if k[0] == tag and k[1] == key]


def test_k1_timed_out_wait_is_reported_once(backend, tune, k1_case):
    key, kw = k1_case(layer=1, R=2, L=2)
    a = clone(kw)
    backend.kda_pre(key, **a)
    assert backend.health() == []
    tune.update(spin=8)
    (sc,) = _scratch("k1", key)
    sc["ctr"][1] = -1  # x-chunks-ready count left short: the in_proj programs wait for a chunk that never comes
    b = clone(kw)
    backend.kda_pre(key, **b)
    msgs = backend.health()
    assert len(msgs) == 1 and msgs[0].startswith("k1 attnres+in_proj: ticket wait timed out"), msgs
    assert "device cpu" in msgs[0]
    assert backend.health() == []  # cleared by the read
    c = clone(kw)
    backend.kda_pre(key, **c)
    assert backend.health() == []
    for n in ("core_out", "prefix", "conv_state", "rstate"):
        assert torch.equal(c[n], a[n]), n


def test_k2_timed_out_wait_and_open_handshake(backend, tune, k2_case):
    key, ranks = k2_case(fmt="mxfp4", layer=1, S=3)
    runs = [[dict(clone(r)) for r in ranks] for _ in range(3)]
    ref.k2_world(key, runs[0], launch=backend.k2_launch)
    assert backend.health() == []
    tune.update(spin=4)
    for sc in _scratch("k2", key):
        sc["ctr_up"][1] = -1  # latent-norm rows ready, one short, on every rank
    ref.k2_world(key, runs[1], launch=backend.k2_launch)
    msgs = backend.health()
    assert len(msgs) == len(ranks) and all(m.startswith("k2 latent norm+up_proj: ticket wait timed out") for m in msgs)
    assert {m.split("(rank ")[1] for m in msgs} == {f"{r})" for r in range(len(ranks))}
    # a handshake counter left open (a launch that died half way) is reported too, and cleared
    _scratch("k2", key)[0]["ctr_lb"][0] = 2
    msgs = backend.health()
    assert len(msgs) == 1 and "routed gemm2" in msgs[0] and "not reset" in msgs[0]
    assert backend.health() == []
    ref.k2_world(key, runs[2], launch=backend.k2_launch)
    assert backend.health() == []
    for r in range(len(ranks)):
        assert torch.equal(runs[2][r]["out"], runs[0][r]["out"])
