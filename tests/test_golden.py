"""Golden files: the committed set is reproduced by the reference (exact bit-for-bit on the CPU,
oracle within 1e-12), and regen shows changes, refuses without --force, and is atomic."""
from __future__ import annotations

import pytest
import torch

import ref
from harness import golden
from harness.cli import main as cli_main
from harness.errors import InputError

pytestmark = pytest.mark.cpu

SMALL = (golden.Case("bf16", "1", 1, 1, 2, 1, ((2, 1),)),)


def snapshot(d):
    return {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def test_committed_golden_set_is_reproduced():
    live = golden.GOLDEN_DIR / golden.SET
    assert (live / "manifest.json").is_file(), "no golden set: run `k3verify golden regen`"
    assert golden.check(golden.GOLDEN_DIR) == []


def test_committed_golden_set_coverage():
    from harness import capture as cap

    sets = [cap.load_set(p) for p in cap.discover(golden.GOLDEN_DIR / golden.SET)]
    assert {cs.fmt for cs in sets} == {"bf16", "mxfp4", "int4"}
    assert {cs.kind for cs in sets} == {"kda", "mla"}
    assert {cs.k2_key.reset for cs in sets} == {True, False}
    kda = [cs for cs in sets if cs.kind == "kda"]
    assert any(not cs.k1_key.delta for cs in kda)  # layer 0: no pending delta
    padded = [cs for cs in kda if int(cs.inputs(0, "k1")["st_idx"].min()) <= 0]
    assert padded
    acc = {}  # qlen -> acceptance counts of real requests
    for cs in kda:
        st, na = cs.inputs(0, "k1")["st_idx"], cs.inputs(0, "k1")["num_acc"]
        acc.setdefault(cs.k1_key.qlen, set()).update(a for a, row in zip(na.tolist(), st.tolist()) if row[0] > 0)
    assert acc[2] == {1, 2} and acc[4] == {1, 2, 3, 4}, acc
    size = sum(p.stat().st_size for p in (golden.GOLDEN_DIR / golden.SET).rglob("*") if p.is_file())
    assert size < 5_000_000


def test_regen_lifecycle(tmp_path, monkeypatch):
    lines = []
    kw = dict(cases=SMALL, progress=False, out=lines.append)
    assert golden.regen(tmp_path, **kw) == 0
    live = tmp_path / golden.SET
    assert golden.check(tmp_path) == []
    first = snapshot(live)
    # unchanged: nothing rewritten
    lines.clear()
    assert golden.regen(tmp_path, **kw) == 0 and "up to date" in lines[-1]
    assert snapshot(live) == first
    # a different generator: the changes are listed, and nothing is written without --force
    monkeypatch.setattr(golden, "SEED", golden.SEED + 1)
    lines.clear()
    assert golden.regen(tmp_path, **kw) == 1
    text = "\n".join(lines)
    assert "refusing to overwrite" in text and "k1.after.core_out" in text and "max |Δ|" in text
    assert snapshot(live) == first
    assert not list(tmp_path.glob(".set.*"))
    assert golden.regen(tmp_path, force=True, **kw) == 0
    second = snapshot(live)
    assert second != first and golden.check(tmp_path) == []
    # interrupted mid-build: the old set stays, no half-built folder is left
    def boom(cs):
        raise KeyboardInterrupt

    monkeypatch.setattr(golden, "SEED", golden.SEED + 1)
    monkeypatch.setattr(golden, "run_reference", boom)
    with pytest.raises(KeyboardInterrupt):
        golden.regen(tmp_path, force=True, **kw)
    assert snapshot(live) == second and not list(tmp_path.glob(".set.*"))
    monkeypatch.undo()
    # interrupted between the two renames of the swap: the next run puts the old set back
    monkeypatch.setattr(golden, "SEED", golden.SEED + 1)
    (live).rename(tmp_path / ".set.old-crash")
    lines.clear()
    assert golden.regen(tmp_path, **kw) == 0 and "up to date" in lines[-1]
    assert snapshot(live) == second


def test_check_detects_a_changed_reference(tmp_path, monkeypatch):
    assert golden.regen(tmp_path, cases=SMALL, progress=False, out=lambda s: None) == 0
    real = ref.kda_pre

    def nudged(key, **kw):  # a reference one bf16 ulp off in one element of core_out
        real(key, **kw)
        c = kw["core_out"]
        c[0, 0] = c[0, 0] * (1 + 2 ** -7) + (2 ** -7 if c.dtype == torch.float64 else 0)

    monkeypatch.setattr(ref, "kda_pre", nudged)
    problems = golden.check(tmp_path)
    assert any("k1.exact.core_out" in p and "not bit-identical" in p for p in problems), problems
    assert any("k1.oracle.core_out" in p and "oracle max" in p for p in problems), problems


def test_check_rejects_edited_files(tmp_path, capsys):
    assert golden.regen(tmp_path, cases=SMALL, progress=False, out=lambda s: None) == 0
    exp = next((tmp_path / golden.SET).rglob("expected/*.safetensors"))
    data = bytearray(exp.read_bytes())
    data[-1] ^= 1
    exp.write_bytes(bytes(data))
    with pytest.raises(InputError) as e:
        golden.check(tmp_path)
    assert e.value.field == "files" and str(exp) in str(e.value)
    assert cli_main(["golden", "check", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sha256" in err[0]


def test_check_on_another_platform(tmp_path, monkeypatch):
    """Another torch/CPU: exact outputs are judged to fp32/bf16 reassociation noise (and it says
    so); a real change still fails; --strict keeps bit-for-bit."""
    assert golden.regen(tmp_path, cases=SMALL, progress=False, out=lambda s: None) == 0
    real = ref.kda_pre

    def reassociated(key, **kw):  # one fp32 ulp on one recurrent-state element, as a reordered sum gives
        real(key, **kw)
        rs = kw["rstate"]
        if rs.dtype == torch.float32:
            i = int(rs.abs().reshape(-1).argmax())
            rs.view(-1)[i] = torch.nextafter(rs.view(-1)[i], torch.tensor(float("inf")))

    monkeypatch.setattr(ref, "kda_pre", reassociated)
    monkeypatch.setattr(golden, "platform_fingerprint", lambda: {"torch": "other", "cpu_capability": "X",
                                                                 "machine": "y"})
    notes = []
    assert golden.check(tmp_path, notes=notes) == []
    assert notes and "not bit for bit" in notes[0]
    assert any("k1.exact.rstate" in p for p in golden.check(tmp_path, strict=True))

    def changed(key, **kw):
        real(key, **kw)
        kw["core_out"].mul_(1.05)

    monkeypatch.setattr(ref, "kda_pre", changed)
    assert any("k1.exact.core_out" in p and "relaxed" in p for p in golden.check(tmp_path))
