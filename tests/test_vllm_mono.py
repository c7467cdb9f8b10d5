"""`--backend vllm-mono`: the mapping from k3verify's contract to vLLM's mono ABI, checked against
the stand-in of vLLM's modules (tests/standin: the public code's ABI names, host launchers and
mailbox rules, with k3verify's reference as the kernels). On this CPU the adapter runs K1
through the stand-in under a faked ROCm device, K2 in two gloo processes."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent

def _standin_env():
    """tests/standin/standin_env.py, loaded without putting the stand-in `vllm` on sys.path for good."""
    spec = importlib.util.spec_from_file_location("standin_env", HERE / "standin" / "standin_env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


standin = _standin_env().standin

import ref  # noqa: E402
from fast import load_backend  # noqa: E402
from fast.vllm_mono import VllmMonoBackend, _Device  # noqa: E402
from fast.vllm_mono import abi as vm  # noqa: E402
from harness import capture as cap  # noqa: E402
from harness.engine import run_step  # noqa: E402
from harness.replay import step_from_set  # noqa: E402
from harness.synth import synthesize  # noqa: E402
from ref.abi import ArgError  # noqa: E402
from ref.config import get_config  # noqa: E402

pytestmark = pytest.mark.cpu
TINY = get_config("tiny")


def fake_rocm(monkeypatch, arch="gfx950:sramecc+:xnack-"):
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace(gcnArchName=arch))


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    """Tiny synthetic captures of layers 0-3 (dense, KDA, block-write KDA, MLA), one step, mxfp4."""
    d = tmp_path_factory.mktemp("caps")
    synthesize("tiny", "0-3", steps=1, num_spec=1, experts="mxfp4", seed=5, out=d, requests=3, padding=1,
               progress=False, git=False)
    return {p.name: p for p in cap.discover(d)}


# ------------------------------------------------------------------ names and order


def test_abi_names_are_the_public_codes():
    """REAL-SYSTEM §1.2 / §1.3, read from kda.py / layer.py @156b0271: 30 and 28 names, this order."""
    assert len(vm.K1_ABI) == 30 and len(vm.K2_ABI) == 28
    with standin():
        from vllm.models.kimi_k3.amd.mono import layer
        from vllm.models.kimi_k3.amd.mono.attention import kda

        assert kda.ABI.names == vm.K1_ABI and layer.ABI.names == vm.K2_ABI


def _spy_build(monkeypatch, mod):
    """Replace a stand-in module's `build` so a launch hands its packed arguments over."""
    got = []
    monkeypatch.setattr(mod, "build", lambda key: (lambda *a, stream=None: got.append(a)))
    return got


def test_k1_mapping_is_what_the_host_launcher_packs(monkeypatch, captures):
    """k3verify's K1 arguments -> vLLM's host-launcher keywords -> the 30 kernel arguments: the
    adapter's own packing (strides of a transposed conv view, strided state slots, the slot)
    equals the stand-in host launcher's, name by name, in ABI order."""
    cs = cap.load_set(captures["s00000_l001"])
    args = cs.k1_args(0, layout="full")
    a = dict(args)
    # vLLM's buffers: conv state [slots, state_len, dim] seen dim-first, state slots in padded pages
    a["conv_state"] = args["conv_state"].transpose(1, 2).contiguous().transpose(1, 2)
    rs = args["rstate"]
    page = torch.zeros(rs.shape[0], rs[0].numel() + 32)
    a["rstate"] = page.as_strided(rs.shape, (page.stride(0),) + rs[0].stride()).copy_(rs)
    scratch, epoch = torch.zeros(64, dtype=torch.uint8), torch.zeros(1, dtype=torch.int32)
    real = vm.k1_to_real(cs.k1_key, a, scratch=scratch, epoch=epoch, layer=cs.layer)
    assert real["layer"] == 1 and real["tl"] is None and real["x_dbg"] is None
    with standin():
        from vllm.models.kimi_k3.amd.mono.attention import kda

        got = _spy_build(monkeypatch, kda)
        kda.kda_pre(vm.k1_real_key(cs.k1_key, kda.KdaPreBuild), **real)
        (packed,) = got
    mine = vm.k1_abi(real)
    assert list(mine) == list(vm.K1_ABI)
    for name, want, have in zip(vm.K1_ABI, packed, mine.values()):
        assert (have is want) if isinstance(want, torch.Tensor) or want is None else have == want, name
    assert (mine["cs_seq"], mine["cs_dim"], mine["cs_tok"]) == a["conv_state"].stride()
    assert mine["cs_dim"] == 1 and mine["rs_seq"] == page.stride(0)
    # and back: the ABI form rebuilds the same [slots, C, SL] view the kernel addresses
    back = vm.k1_from_real(cs.k1_key, {k: v for k, v in mine.items() if k != "conv_state"})
    assert back["conv_state"].stride() == a["conv_state"].stride()
    assert back["conv_state"].data_ptr() == a["conv_state"].data_ptr()
    assert torch.equal(back["conv_state"], a["conv_state"]) and torch.equal(back["rstate"], a["rstate"])


def test_k2_mapping_is_what_the_host_launcher_packs(monkeypatch, captures):
    cs = cap.load_set(captures["s00000_l003"])
    args = cs.k2_args(1)
    scratch, epoch, peers = torch.zeros(64, dtype=torch.uint8), torch.zeros(1, dtype=torch.int32), torch.arange(2)
    real = vm.k2_to_real(args, scratch=scratch, peers=peers, rank=1, epoch=epoch, layer=cs.layer)
    assert real["layer"] == 128 + 3 and real["rank"] == 1 and real["diag"] is None
    with standin():
        from vllm.models.kimi_k3.amd.mono import layer

        got = _spy_build(monkeypatch, layer)
        layer.k2_launch(vm.k2_real_key(cs.k2_key, layer.K2Build), **real)
        (packed,) = got
    mine = vm.k2_abi(real)
    assert list(mine) == list(vm.K2_ABI)
    for name, want, have in zip(vm.K2_ABI, packed, mine.values()):
        assert (have is want) if isinstance(want, torch.Tensor) or want is None else have == want, name


def test_build_keys_both_ways():
    with standin():
        from vllm.models.kimi_k3.amd.mono import layer
        from vllm.models.kimi_k3.amd.mono.attention import kda

        real = kda.KdaPreBuild(tokens=6, qlen=2, nblocks=1, delta=True, state_len=4, eps=2e-5, out_eps=3e-5,
                               onorm_eps=4e-5, lower_bound=-4.0, write_idx=-1)
        k3, extra = vm.k1_key_from_real(real)
        assert vm.k1_real_key(k3, kda.KdaPreBuild) == real
        assert vm.k1_real_key(k3, kda.KdaPreBuild, debug=True).debug
        r2 = layer.K2Build(tokens=6, nblocks=2, eps=1e-4, out_eps=2e-4, ln_eps=3e-4, reset=True)
        k2, _ = vm.k2_key_from_real(r2, 4, 4.0, 25.0, "mxfp4")
        assert (k2.topk, k2.situ_beta, k2.situ_linear_beta, k2.experts, k2.reset) == (4, 4.0, 25.0, "mxfp4", True)
        back = vm.k2_real_key(k2, layer.K2Build)
        assert back == r2 and back.reduce
    assert vm.model_layer("k1", 5) == 5 and vm.model_layer("k2", 133) == 5 and vm.real_slot("k2", 5) == 133
    with pytest.raises(ArgError, match="128 \\+ layer_idx"):
        vm.model_layer("k2", 5)
    u8, bf = torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.bfloat16)
    assert [vm.expert_format(u8, u8), vm.expert_format(u8, bf), vm.expert_format(bf, None)] == ["mxfp4", "int4",
                                                                                                 "bf16"]


# ------------------------------------------------------------------ available()


def test_available_says_why_not(monkeypatch):
    b = VllmMonoBackend()
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", None)
    ok, why = b.available()
    assert not ok and why.startswith("no ROCm device: this torch") and "CPU-only build" in why
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "CUDA 12.8 build" in b.available()[1]
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert b.available() == (False, "no ROCm device visible (torch.cuda.is_available() is False)")
    fake_rocm(monkeypatch)
    ok, why = b.available()
    assert not ok and why.startswith("vLLM mono modules not importable") and "vllm" in why
    with standin():
        assert VllmMonoBackend().available() == (True, "gfx950, vLLM mono kernels (attention layout)")
        fake_rocm(monkeypatch, "gfx942:sramecc+:xnack-")
        ok, why = VllmMonoBackend().available()
        assert not ok and why.startswith("device is gfx942; vLLM's mono kernels run on gfx950")
        fake_rocm(monkeypatch)
        from vllm.models.kimi_k3.amd.mono.attention import kda

        monkeypatch.setattr(kda, "ABI", type(kda.ABI)(kda.ABI.names[:-1]))  # a drifted ABI
        ok, why = VllmMonoBackend().available()
        assert not ok and "K1 ABI" in why and "29 names" in why


def test_registered_as_a_builtin_backend():
    b = load_backend("vllm-mono")
    assert b.name == "vllm-mono" and b.TAPS_K1 == ("x", "proj") and b.TAPS_K2 == ()


# ------------------------------------------------------------------ running K1 through the stand-in


def test_k1_through_the_adapter_is_the_kernels_result(monkeypatch, captures):
    """The engine's K1 (poisoned extra slots, NaN core_out) through the adapter and the stand-in's
    kernel (the reference) equals the reference bit for bit, taps x and proj from the debug dumps;
    its K2 is refused under the simulated world and the replay judges K1 alone."""
    fake_rocm(monkeypatch)
    with standin():
        b = VllmMonoBackend()
        for name in ("s00000_l001", "s00000_l002"):
            cs = cap.load_set(captures[name])
            sr = run_step(step_from_set(cs, "cpu"), b)
            k1 = [p for p in sr.pairs if p.stage in ("k1", "untouched") and p.name != "k2_blocks"]
            assert {p.name for p in k1} >= {"prefix", "core_out", "conv_state", "rstate", "x", "proj"}
            for p in k1:
                assert bits_equal(p.cand, p.ref), (name, p.name, p.rank)
            assert not [p for p in sr.pairs if p.stage == "k2"]
            assert sr.missing_taps["k1"] == ["conv_out", "gate", "beta", "o"]
            assert len(sr.errors) == 1 and "simulated world of one process cannot drive it" in sr.errors[0]


def bits_equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(cap.same_bits(a, b).all())


def _k1_launch(b, cs, rank=0, **extra):
    a = cs.k1_args(rank)
    b.kda_pre(cs.k1_key, **a, **extra)
    return a


def test_epoch_bumped_before_every_launch(monkeypatch, captures):
    """vLLM's mailboxes are tagged epoch·256 + slot and never zeroed: a second launch of one slot
    in one epoch would read the first one's pairs. The adapter bumps the epoch every launch; with
    the bump taken out (a planted bug) the stand-in's mailbox model refuses the second launch."""
    fake_rocm(monkeypatch)
    cs = cap.load_set(captures["s00000_l001"])
    with standin():
        b = VllmMonoBackend()
        for _ in range(3):
            _k1_launch(b, cs)
        assert int(b._dev[torch.device("cpu")].epoch) == 3
        monkeypatch.setattr(_Device, "next_epoch", lambda self: self.epoch)
        b = VllmMonoBackend()
        _k1_launch(b, cs)
        with pytest.raises(RuntimeError, match="used twice on one scratch"):
            _k1_launch(b, cs)


def test_k1_weights_upcast_for_the_kernel(monkeypatch, captures):
    """vLLM's K1 reads conv_w, a_log, dt_bias as fp32: a capture's bf16 conv_w goes in upcast (exact),
    and the result is the reference's on the bf16 weight."""
    fake_rocm(monkeypatch)
    cs = cap.load_set(captures["s00000_l001"])
    a = cs.k1_args(0)
    a["conv_w"] = a["conv_w"].to(torch.bfloat16)
    want = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    ref.kda_pre(cs.k1_key, **want)
    with standin():
        VllmMonoBackend().kda_pre(cs.k1_key, **a)
    for n in ("core_out", "conv_state", "rstate", "prefix"):
        assert bits_equal(a[n], want[n]), n


def test_k1_refusals_name_the_field(monkeypatch, captures):
    fake_rocm(monkeypatch)
    with standin():
        from vllm.models.kimi_k3.amd.mono.attention import kda

        b = VllmMonoBackend()
        with pytest.raises(ArgError, match="key.nblocks: 0: vLLM's K1 builds need nblocks >= 1"):
            _k1_launch(b, cap.load_set(captures["s00000_l000"]))
        monkeypatch.setattr(kda, "HIDDEN", 7168)
        with pytest.raises(ArgError, match=r"w_in: dims \(160, 128\), vLLM's kernels are built for \(160, 7168\)"):
            _k1_launch(b, cap.load_set(captures["s00000_l001"]))


def test_k2_refused_under_the_simulated_world(monkeypatch, captures):
    fake_rocm(monkeypatch)
    cs = cap.load_set(captures["s00000_l003"])
    with standin():
        with pytest.raises(ArgError, match="comm: vllm-mono's K2 reduces in-kernel over IPC-mapped peer buffers"):
            ref.k2_world(cs.k2_key, cs.k2_world_args(), launch=VllmMonoBackend().k2_launch)


def test_experts_in_the_kernels_layout_need_aiter():
    a = {n: torch.zeros(2, 64, 16, dtype=torch.uint8) for n in ("w13", "w13s", "w2", "w2s")}
    with pytest.raises(ArgError, match="w13: AITER's a16w4 shuffle is not importable"):
        VllmMonoBackend()._kernel_experts(_Device("cpu"), a)
    assert VllmMonoBackend("logical")._kernel_experts(_Device("cpu"), a) == {}


# ------------------------------------------------------------------ K2: every rank a live process


def _worker(rank: int, world: int, init: str, set_path: str, out: str) -> None:
    """One TP rank (the stand-in is on the path: this file put it there), gloo; K1 then K2 through the adapter."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from harness.engine import chain_k2
    from ref.comm import DistComm

    sys.path.insert(0, str(HERE / "standin"))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        cs = cap.load_set(set_path)
        b = VllmMonoBackend("logical")  # the stand-in's kernel reads DESIGN §7's layout
        k1 = None
        if cs.has_k1:
            k1 = cs.k1_args(rank)
            b.kda_pre(cs.k1_key, **k1)
        (k2,) = chain_k2(None if k1 is None else [k1], [cs.k2_args(rank)])
        b.k2_launch(cs.k2_key, **k2, rank=rank, comm=DistComm())
        save_file({"out": k2["out"], "prefix": k2["prefix"]}, os.path.join(out, f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["s00000_l002", "s00000_l003"])  # block-write KDA (K1 then K2), MLA
def test_k2_through_the_adapter_in_two_gloo_processes(captures, tmp_path, name):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    from safetensors.torch import load_file

    from harness.engine import chain_k2

    env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "2", str(tmp_path / "pg"),
                               str(captures[name]), str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("gloo workers timed out")
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-3000:]}"
    cs = cap.load_set(captures[name])
    k1 = None
    if cs.has_k1:
        k1 = [cs.k1_args(r) for r in cs.ranks]
        for a in k1:
            ref.kda_pre(cs.k1_key, **a)
    k2 = chain_k2(k1, cs.k2_world_args())
    ref.k2_world(cs.k2_key, k2)
    for r in cs.ranks:
        got = load_file(str(tmp_path / f"rank{r}.safetensors"))
        assert bits_equal(got["out"], k2[r]["out"]) and bits_equal(got["prefix"], k2[r]["prefix"]), r


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
