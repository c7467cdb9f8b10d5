"""The vLLM recording plugin against the stand-in of vLLM's runtime layer and mono modules
(tests/standin): loaded through its entry point as vLLM loads it, a tiny stack (dense layer 0,
KDA, block-write KDA, MLA) served for a few spec-verify steps on 2 simulated ranks; then
`k3verify group` and `k3verify replay`. Bad recordings are one-line errors with exit 2."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch


def _standin_env():
    """tests/standin/standin_env.py, loaded without putting the stand-in `vllm` on sys.path for good."""
    spec = importlib.util.spec_from_file_location("standin_env", Path(__file__).resolve().parent / "standin"
                                                  / "standin_env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


standin = _standin_env().standin

import ref  # noqa: E402
from harness import capture as cap  # noqa: E402
from harness import vllm_plugin  # noqa: E402
from harness.cli import main  # noqa: E402
from harness.errors import InputError  # noqa: E402
from ref import synth as rsynth  # noqa: E402
from ref.config import get_config  # noqa: E402

pytestmark = pytest.mark.cpu

TINY = get_config("tiny")
LAYERS = [0, 1, 2, 3]  # dense, KDA, block-write KDA, MLA
STEPS = 3
ROOT = Path(__file__).resolve().parent.parent


def _entry_point():
    """The plugin's entry point as pyproject.toml declares it, loaded as vLLM loads plugins."""
    from harness.policy import tomllib

    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"k3verify_record": "harness.vllm_plugin:register"}
    assert vllm_plugin.ENTRY_POINT == "k3verify_record = harness.vllm_plugin:register"
    return EntryPoint("k3verify_record", eps["k3verify_record"], "vllm.general_plugins").load()


def record(out: Path, steps: int = STEPS, env: dict | None = None, before=None, **serve_kw):
    """Serve the tiny stack on 2 simulated ranks with the plugin on; returns each rank's outputs."""
    e = {"K3VERIFY_RECORD": str(out), "K3VERIFY_RECORD_CONFIG": "tiny", "K3VERIFY_RECORD_EXPERT_LAYOUT": "logical"}
    e.update(env or {})
    with standin(e):
        _entry_point()()
        import k3_runtime

        if before is not None:
            before()
        return k3_runtime.serve_world(TINY, LAYERS, steps, **serve_kw)


def group(path, capsys, *extra):
    capsys.readouterr()  # what the recording said
    rc = main(["group", str(path), *extra])
    o = capsys.readouterr()
    return rc, o.out, o.err


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm") / "rec"
    outs = record(d)
    return d, outs


def bits_equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(cap.same_bits(a, b).all())


def test_entry_point_off_without_env(monkeypatch):
    monkeypatch.delenv("K3VERIFY_RECORD", raising=False)
    n = len(sys.meta_path)
    _entry_point()()
    assert vllm_plugin._State.settings is None and len(sys.meta_path) == n


def test_recording_does_not_change_the_computation(recording):
    _, outs = recording
    with standin():
        import k3_runtime

        plain = k3_runtime.serve_world(TINY, LAYERS, STEPS)
    for r in range(TINY.world):
        for a, b in zip(outs[r], plain[r]):
            assert torch.equal(a, b)


def test_group_then_replay_ref(recording, capsys, tmp_path):
    d, _ = recording
    out = tmp_path / "sets"
    rc, o, e = group(d, capsys, "--out", str(out))
    assert rc == 0 and e == "", e
    assert "12 capture set(s) of world 2" in o
    assert [p.name for p in cap.discover(out)] == [f"s{t:05d}_l{i:03d}" for t in range(STEPS) for i in LAYERS]
    # grouping again finds the same files there: nothing written, nothing refused
    assert group(d, capsys, "--out", str(out))[0] == 0
    assert main(["replay", str(out), "--backend", "ref", "--isolate", "--quiet"]) == 0
    assert "**PASS**" in capsys.readouterr().out


def test_recorded_captures_are_what_the_kernels_saw_and_wrote(recording, capsys, tmp_path):
    """Inputs before the launch, outputs after: the reference re-run on a capture's inputs
    reproduces the recorded outputs bit for bit; each rank's file holds that rank's weights
    (the worker's rank, not the call order); kinds follow the config."""
    d, _ = recording
    out = tmp_path / "sets"
    assert group(d, capsys, "--out", str(out))[0] == 0
    kinds = set()
    for p in cap.discover(out):
        cs = cap.load_set(p)
        kinds.add(cs.kind)
        assert cs.kind == TINY.kind(cs.layer) and cs.world == 2
        man = cs.captures[0].manifest
        assert man["producer"]["tool"] == "k3verify vllm plugin" and man["experts"] in ("mxfp4", "bf16")
        if cs.has_k1:
            w_in = [rsynth.k1_weights(TINY, cs.layer, r)["w_in"] for r in cs.ranks]
            assert not torch.equal(w_in[0], w_in[1])
            for r in cs.ranks:
                assert torch.equal(cs.weights(r, "k1")["w_in"], w_in[r])
                a = cs.k1_args(r)
                ref.kda_pre(cs.k1_key, **a)
                for n, want in cs.after(r, "k1").items():
                    assert bits_equal(a[n], want), (p.name, r, n)
            assert man["state"]["conv_layout"] == "slc"  # vLLM's default conv layout, [slots, state_len, dim]
        if cs.has_k2:
            for r in cs.ranks:
                assert torch.equal(cs.weights(r, "k2")["w_o"], rsynth.k2_weights(TINY, cs.layer, r, "mxfp4")["w_o"])
            ranks = cs.k2_world_args()
            if cs.has_k1:  # K2 of a KDA layer reads what K1 wrote
                for r in cs.ranks:
                    assert bits_equal(cs.inputs(r, "k2")["core"], cs.after(r, "k1")["core_out"])
            ref.k2_world(cs.k2_key, ranks)
            for r in cs.ranks:
                for n, want in cs.after(r, "k2").items():
                    assert bits_equal(ranks[r][n], want), (p.name, r, n)
    assert kinds == {"dense", "kda", "mla"}
    # the dense layer's MLP output is the next layer's pending delta
    d0, d1 = cap.load_set(out / "s00001_l000"), cap.load_set(out / "s00001_l001")
    assert d0.k2_key is None and d1.k1_key.delta
    # a block-write layer: K2 with reset, its key mapped from vLLM's K2Build
    k2 = cap.load_set(out / "s00001_l002").k2_key
    assert k2.reset and k2.nblocks == TINY.k2_nblocks(2) and k2.topk == TINY.topk and k2.experts == "mxfp4"


@pytest.mark.interpret
@pytest.mark.slow
def test_group_then_replay_triton_interpreted(recording, capsys, tmp_path):
    import triton_tier  # noqa: F401  (TRITON_INTERPRET=1 before triton is imported, where there is no GPU)
    from fast.triton import _jit

    if not _jit.INTERP:
        pytest.skip("fast.triton is compiled here (a GPU node); `k3verify replay --backend triton` covers it there")
    d, _ = recording
    out = tmp_path / "sets"
    assert group(d, capsys, "--out", str(out))[0] == 0
    # step 0: dense, KDA, block-write KDA and MLA layers
    assert main(["replay", str(out), "--backend", "triton", "--isolate", "--limit", "4", "--quiet"]) == 0
    assert "**PASS**" in capsys.readouterr().out


# ------------------------------------------------------------------ bad recordings


def _copy(recording, tmp_path) -> Path:
    d = tmp_path / "rec"
    shutil.copytree(recording[0], d, ignore=shutil.ignore_patterns("sets"))
    return d


def test_missing_rank(recording, tmp_path, capsys):
    d = _copy(recording, tmp_path)
    shutil.rmtree(d / "rank1")
    rc, o, e = group(d, capsys)
    lines = e.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "rank 1 missing" in lines[0] and "world 2" in lines[0]
    assert "0 capture set(s)" in o


def test_step_recorded_on_some_ranks_only(recording, tmp_path, capsys):
    d = _copy(recording, tmp_path)
    (d / "rank1" / "s00001_l002" / "rank1.safetensors").unlink()
    rc, o, e = group(d, capsys)
    assert rc == 2 and e.strip().splitlines() == [
        "k3verify group: error: step 1: layer(s) 2 recorded on rank(s) 0 only (world 2); not assembled"]
    assert "11 capture set(s)" in o  # the complete ones are still assembled


def test_unreadable_recording_is_a_usage_error(tmp_path, capsys):
    rc, _, e = group(tmp_path, capsys)
    assert rc == 2 and "no per-rank recording here" in e


def _est(capture_files) -> int:
    """Bytes the recorder counts for captures (tensors as listed, aliases too, plus 16 KiB each) and
    their weight files, as harness/recorder.py does."""
    size = {"bfloat16": 2, "float32": 4, "int32": 4, "int64": 8, "uint8": 1, "float64": 8}
    n, weights = 0, set()
    for f in capture_files:
        c = cap.load_capture(f, verify=False)
        m = c.manifest
        full = {}  # schema 2 stores part of the caches and bank; the recorder counts them whole
        for name, e in m["tensors"].items():
            sh = list(e["shape"])
            if name.endswith((".conv_state", ".rstate")):
                sh[0] = m["tensors"]["state.slot_map"]["shape"][0]
            elif name.endswith(".blocks"):
                sh[1] = m["bank_rows"]
            full[name] = size[e["dtype"]] * int(torch.tensor(sh).prod())
        n += 16384 + sum(full.values())
        weights |= {w["sha256"] for w in c.manifest["weights"].values() if w}
    for a in weights:
        w = cap.load_weights(next(Path(capture_files[0]).parents[1].glob(f"weights/{a}.safetensors")), verify=False)
        n += sum(t.numel() * t.element_size() for t in w.values())
    return n


def test_budget_exceeded_mid_step_drops_the_step(recording, tmp_path, capsys):
    d0 = recording[0] / "rank0"
    first = _est([d0 / "s00000_l000" / "rank0.safetensors"])
    d = tmp_path / "rec"
    record(d, steps=1, env={"K3VERIFY_RECORD_BUDGET": str(first + 1000)})
    said = capsys.readouterr().err
    assert "step 0 dropped whole (1 capture(s) of it removed)" in said  # the recorder says it as it drops
    journal = [json.loads(x) for x in (d / "rank0" / "journal.jsonl").read_text().splitlines()]
    drop = [e for e in journal if e["event"] == "dropped"]
    assert len(drop) == 1 and drop[0]["step"] == 0 and drop[0]["removed"] == ["s00000_l000/rank0.safetensors"]
    assert not list(d.glob("rank*/s*/rank*.safetensors"))  # the whole step is gone on every rank
    rc, o, e = group(d, capsys)
    assert rc == 2 and e.strip().splitlines() == [
        f"k3verify group: error: step 0 dropped whole on rank(s) 0,1: budget of {first + 1000} bytes exceeded "
        "mid-step"]


def test_budget_between_steps_stops_cleanly(recording, tmp_path, capsys):
    d0 = recording[0] / "rank0"
    step0 = _est(sorted(d0.glob("s00000_l*/rank0.safetensors")))
    d = tmp_path / "rec"
    record(d, steps=3, env={"K3VERIFY_RECORD_BUDGET": str(step0 + 4096)})
    rc, o, e = group(d, capsys)
    assert rc == 0 and e == ""
    assert "4 capture set(s)" in o and "recording stopped before step 1" in o


@dataclass(frozen=True)
class _Wider:
    """vLLM's KdaPreBuild with a field this k3verify does not know."""

    tokens: int
    qlen: int
    nblocks: int
    delta: bool
    state_len: int
    eps: float = 1e-5
    out_eps: float = 1e-5
    onorm_eps: float = 1e-5
    lower_bound: float = -5.0
    debug: bool = False
    timeline: bool = False
    write_idx: int = -1
    kda0: int = 0
    xp: int = 0
    split_k: int = 2


def test_unknown_build_key_field(tmp_path, capsys):
    def widen():
        from vllm.models.kimi_k3.amd.mono.attention import kda

        kda.KdaPreBuild = _Wider

    d = tmp_path / "rec"
    record(d, steps=1, before=widen, env={"K3VERIFY_RECORD_LAYERS": "1"})
    rc, o, e = group(d, capsys)
    lines = e.strip().splitlines()
    assert rc == 2 and len(lines) == 2  # one line a rank
    assert all("k1 of layer 1 not recorded: k1_key.split_k: unknown KdaPreBuild field (= 2)" in x for x in lines)
    assert "launches not recorded: 1 k2 without k1" in o  # its K2 had no K1 to pair with


def test_timing_experiment_key_is_refused(tmp_path, capsys):
    from fast.vllm_mono import abi as vm
    from ref.abi import ArgError

    with standin():
        from vllm.models.kimi_k3.amd.mono import layer
        from vllm.models.kimi_k3.amd.mono.attention import kda

        with pytest.raises(ArgError, match="k1_key.xp: 1: a timing experiment"):
            vm.k1_key_from_real(kda.KdaPreBuild(tokens=4, qlen=2, nblocks=1, delta=True, state_len=4, xp=1))
        with pytest.raises(ArgError, match="k2_key.reduce: False"):
            vm.k2_key_from_real(layer.K2Build(tokens=4, nblocks=1, reduce=False), 4, 4.0, 25.0, "mxfp4")
        k, extra = vm.k1_key_from_real(kda.KdaPreBuild(tokens=4, qlen=2, nblocks=1, delta=True, state_len=4,
                                                       debug=True, timeline=True, kda0=3))
        assert extra == {"debug": True, "timeline": True, "kda0": 3, "xp": 0} and k.tokens == 4


# ------------------------------------------------------------------ CUDA graphs, filters, settings


def _graph_flag():
    """The stand-in's breakable-graph state: what is_current_stream_capturing says while it serves."""
    rt = sys.modules.get("k3_runtime")
    return bool(rt and rt.Graph.capturing())


def test_cuda_graph_capture_and_replay(tmp_path, capsys, monkeypatch):
    """A captured forward (vLLM's breakable graph: step_begin and K2 inside the capture, K1 an
    eager break) and its replay (K1 again, without step_begin) record nothing; no hash (a host
    sync) runs inside the capture; the eager forwards after it are recorded and replay."""
    synced = []
    real_sha = cap.tensor_sha256

    def sha(t):
        if _graph_flag():
            synced.append(True)
        return real_sha(t)

    monkeypatch.setattr(cap, "tensor_sha256", sha)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", _graph_flag)
    d = tmp_path / "rec"
    record(d, steps=3, graph_steps=(0,))
    assert not synced
    err = capsys.readouterr().err
    assert err.count("a launch during CUDA-graph capture is not recorded") == 1  # one warning a process
    rc, o, e = group(d, capsys)
    assert rc == 0, e
    sets = sorted(p.name for p in (d / "sets").iterdir() if p.name.startswith("s"))
    assert sets == [f"s{t:05d}_l{i:03d}" for t in (1, 2) for i in LAYERS]
    journal = [json.loads(x) for x in (d / "rank0" / "journal.jsonl").read_text().splitlines()]
    # the capture's eager K1 breaks (3 KDA layers) and the replay's (3 more)
    assert journal[-1]["event"] == "close" and journal[-1]["skipped"] == {"graph": 6}
    monkeypatch.undo()
    assert main(["replay", str(d / "sets"), "--backend", "ref", "--quiet"]) == 0


def test_capturing_asks_the_current_stream(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_plugin.capturing() is False  # a CPU build has no stream to ask
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert vllm_plugin.capturing() is True


def test_layer_and_step_filters(tmp_path, capsys):
    d = tmp_path / "rec"
    record(d, steps=2, env={"K3VERIFY_RECORD_LAYERS": "1,3", "K3VERIFY_RECORD_STEPS": "1"})
    assert group(d, capsys)[0] == 0
    assert [p.name for p in cap.discover(d / "sets")] == ["s00001_l001", "s00001_l003"]


def test_plugin_wraps_modules_imported_before_and_after_it(tmp_path):
    with standin({"K3VERIFY_RECORD": str(tmp_path / "a"), "K3VERIFY_RECORD_CONFIG": "tiny"}):
        from vllm.models.kimi_k3.amd.mono.attention import kda  # imported before register

        orig = kda.kda_pre
        vllm_plugin.register()
        from vllm.models.kimi_k3.amd.mono import layer, runner  # imported after: the import hook

        assert kda.kda_pre._k3verify and kda.kda_pre.__wrapped__ is orig
        assert layer.k2_launch._k3verify and runner.step_begin._k3verify
        vllm_plugin.deactivate()
        assert kda.kda_pre is orig and not getattr(layer.k2_launch, "_k3verify", False)


@pytest.mark.parametrize("var,value,msg", [
    ("K3VERIFY_RECORD_BUDGET", "lots", "expected bytes"),
    ("K3VERIFY_RECORD_LAYERS", "3-1", "ranges a-b"),
    ("K3VERIFY_RECORD_CONFIG", "k4", "not a preset"),
    ("K3VERIFY_RECORD_WEIGHTS", "checkpoint:/ckpt", "'stored' only"),
    ("K3VERIFY_RECORD_EXPERT_LAYOUT", "shuffled", "neither aiter nor logical"),
])
def test_bad_settings_are_one_line_errors(tmp_path, var, value, msg):
    with standin({"K3VERIFY_RECORD": str(tmp_path / "r"), var: value}):
        with pytest.raises(InputError, match=msg) as e:
            _entry_point()()
    assert e.value.field == var and "\n" not in str(e.value)


def test_settings_parse():
    assert vllm_plugin.parse_set("1-3,12", "f") == {1, 2, 3, 12} and vllm_plugin.parse_set("all", "f") is None
    assert vllm_plugin.parse_bytes("500M", "f") == 500 << 20 and vllm_plugin.parse_bytes("4GiB", "f") == 4 << 30


def test_refuses_a_folder_holding_a_recording(recording, tmp_path):
    with standin({"K3VERIFY_RECORD": str(recording[0])}):
        with pytest.raises(InputError, match="already holds a recording"):
            _entry_point()()


def test_stored_weights_refuse_shuffled_experts(tmp_path, capsys):
    """vLLM hands its gfx950 K2 AITER-shuffled experts: stored captures hold the logical layout only,
    so the default expert layout refuses K2 (and nothing of a KDA layer is written)."""
    d = tmp_path / "rec"
    record(d, steps=1, env={"K3VERIFY_RECORD_EXPERT_LAYOUT": "aiter", "K3VERIFY_RECORD_LAYERS": "0-1"})
    rc, o, e = group(d, capsys)
    assert rc == 2 and "k2 of layer 1 not recorded: expert weights arrive in the 'aiter' layout" in e
    assert [p.name for p in cap.discover(d / "sets")] == ["s00000_l000"]  # the dense layer has no K2


def test_standin_reads_any_conv_layout(monkeypatch):
    """The fixture's own check: vLLM's two conv-state layouts give the same results through the
    stand-in's pointer + stride unpacking."""
    with standin():
        import k3_runtime

        sd = k3_runtime.serve_world(TINY, [1, 2], 1)
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    with standin():
        import k3_runtime

        ds = k3_runtime.serve_world(TINY, [1, 2], 1)
    assert all(torch.equal(a, b) for r in range(2) for a, b in zip(sd[r], ds[r]))
