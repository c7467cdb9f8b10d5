"""Programmatic dependent launch (TUNE pdl, fast.triton._jit.pdl_enter) changes no bit: K1 and
a K2 world step, several steps back to back in one stream so each launch's programs may start
while the previous launch runs, with pdl off and in both modes (the next launch let in at each
kernel's start, or as its programs exit). NVIDIA only (compiled Triton)."""
from __future__ import annotations

import pytest
import torch

from triton_tier import triton  # noqa: F401  (sets TRITON_INTERPRET first)

import ref  # noqa: E402
from conftest import clone, make_k1, make_k2  # noqa: E402
from ref import config as rcfg  # noqa: E402

pytestmark = pytest.mark.gpu


def _on(kw: dict) -> dict:
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def _steps(backend, k1, k2, n=3):
    """n steps of K1 then the K2 world on the GPU; every output and in-place cache after each step."""
    key1, kw1 = k1
    key2, ranks = k2
    a = _on(clone(kw1))
    rs = [_on(clone(r)) for r in ranks]
    out = []
    for _ in range(n):
        backend.kda_pre(key1, **a)
        ref.k2_world(key2, rs, launch=backend.k2_launch)
        out += [a["core_out"].clone(), a["rstate"].clone(), a["conv_state"].clone(), a["prefix"].clone()]
        out += [r["out"].clone() for r in rs]
    torch.cuda.synchronize()
    return [t.cpu() for t in out]


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_pdl_changes_no_bit(fmt, mode):
    from fast.triton import BACKEND, _jit
    from fast.triton.tuning import TUNE

    if _jit.INTERP or not torch.cuda.is_available() or torch.version.hip is not None or not _jit.HAS_GDC:
        pytest.skip("programmatic dependent launch needs an NVIDIA GPU (compiled Triton)")
    cfg = rcfg.get_config("small")
    k1 = make_k1(cfg, 3, R=2, L=4)
    k2 = make_k2(cfg, 3, fmt=fmt, S=8)
    saved = TUNE["pdl"]
    try:
        TUNE["pdl"] = 0
        off = _steps(BACKEND, k1, k2)
        TUNE["pdl"] = mode
        on = _steps(BACKEND, k1, k2)
    finally:
        TUNE["pdl"] = saved
    assert len(on) == len(off)
    for i, (x, y) in enumerate(zip(on, off)):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"output {i} differs with pdl {mode}"


def test_rec_pdl_and_stamps_change_no_bit():
    """TUNE rec_pdl (the recurrence as k1_mid's programmatic dependent, its state and w_fb loaded
    before the wait), with rec_cnt (that wait a poll of stored in_proj row blocks; with rec_occ
    under a register cap too), k1_part and k1_rst (in_proj's K-split partials summed by the
    recurrence, k1_mid's counters reset by it; with and without rec_pdl),
    and the timeline build (stamps) give the plain launch's bits over
    several K1 steps and leave the backend healthy; every stamped program has start <= after-wait
    <= end."""
    from fast.triton import BACKEND, _host, _jit
    from fast.triton.tuning import TUNE

    if _jit.INTERP or not torch.cuda.is_available() or torch.version.hip is not None or not _jit.HAS_GDC:
        pytest.skip("programmatic dependent launch needs an NVIDIA GPU (compiled Triton)")
    cfg = rcfg.get_config("small")
    key, kw = make_k1(cfg, 3, R=2, L=4)

    def steps():
        a = _on(clone(kw))
        out = []
        for _ in range(3):
            BACKEND.kda_pre(key, **a)
            out += [a["core_out"].clone(), a["rstate"].clone(), a["conv_state"].clone(), a["prefix"].clone()]
        torch.cuda.synchronize()
        return [t.cpu() for t in out]

    saved = dict(TUNE)
    try:
        TUNE.update(saved, rec_pdl=False, stamps=False)
        _host.clear_scratch()
        off = steps()
        cnt = dict(k1_part=False, k1_rst=False)  # rec_cnt's poll does not combine with them
        for over in (dict(rec_pdl=True, rec_cnt=0, stamps=False), dict(rec_pdl=True, rec_cnt=1, stamps=False, **cnt),
                     dict(rec_pdl=True, rec_cnt=2, stamps=False, **cnt),
                     dict(rec_pdl=True, rec_cnt=1, rec_occ=3, stamps=False, **cnt),
                     dict(rec_pdl=True, k1_part=True, k1_rst=True, rec_occ=3, stamps=False),
                     dict(rec_pdl=False, k1_part=True, k1_rst=True, stamps=False),
                     dict(rec_pdl=True, stamps=True)):
            TUNE.update(saved, **over)
            _host.clear_scratch()
            on = steps()
            assert BACKEND.health() == [], over
            for i, (x, y) in enumerate(zip(on, off)):
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"output {i} differs with {over}"
        sc = next(v for k, v in _host._SCRATCH.items() if k[0] == "k1")
        for n in ("tl_mid", "tl_rec"):
            t = sc[n].view(-1, 4).cpu()
            assert (t[:, 0] > 0).all() and (t[:, 1] >= t[:, 0]).all(), n
        assert (sc["tl_mid"].view(-1, 4)[:, 2].cpu() >= sc["tl_mid"].view(-1, 4)[:, 1].cpu()).all()
        assert (sc["tl_rec"].view(-1, 4)[:, 3].cpu() >= sc["tl_rec"].view(-1, 4)[:, 2].cpu()).all()
    finally:
        TUNE.clear()
        TUNE.update(saved)
        _host.clear_scratch()


def test_poll_modes_change_no_bit():
    """TUNE poll_ld (ticket waits polling with volatile loads, one acquire RMW after them) and
    poll_nap (a nanosleep after each unmet poll) give the plain atomic polls' bits over several
    K1 + K2-world steps launched back to back (pdl in mode 1, so waits overlap the previous
    launch), and no wait gives up or leaves a counter behind."""
    from fast.triton import BACKEND, _host, _jit
    from fast.triton.tuning import TUNE

    if _jit.INTERP or not torch.cuda.is_available():
        pytest.skip("the polls only spin on a GPU (the interpreter runs programs in order)")
    cfg = rcfg.get_config("small")
    k1 = make_k1(cfg, 3, R=2, L=4)
    k2 = make_k2(cfg, 3, fmt="mxfp4", S=8)
    saved = dict(TUNE)
    modes = [(False, 0), (True, 0), (False, 300), (True, 300)]
    try:
        res = {}
        for ld, nap in modes:
            TUNE.update(saved, poll_ld=ld, poll_nap=nap, pdl=1 if _jit.HAS_GDC and torch.version.hip is None else 0)
            _host.clear_scratch()
            res[ld, nap] = _steps(BACKEND, k1, k2)
            assert BACKEND.health() == [], f"poll_ld={ld}, poll_nap={nap}"
    finally:
        TUNE.clear()
        TUNE.update(saved)
        _host.clear_scratch()
    for m in modes[1:]:
        for i, (x, y) in enumerate(zip(res[m], res[modes[0]])):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"output {i} differs with poll_ld, poll_nap = {m}"
