"""Golden files: the committed set is reproduced by the reference on any x86-64 CPU (each stage
isolated, within the measured CPU tolerance; bookkeeping bit for bit; oracle within 1e-12), a
planted change to one stage fails, and regen shows changes, refuses without --force, and is
atomic. Run under MKL_CBWR=AVX512|AVX2|SSE4_2|COMPATIBLE and ATEN_CPU_CAPABILITY=avx2|default
to see it hold on every code path."""
from __future__ import annotations

import sys

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
    assert {cs.kind for cs in sets} == {"kda", "mla", "dense"}
    assert {cs.k2_key.reset for cs in sets if cs.has_k2} == {True, False}
    kda = [cs for cs in sets if cs.has_k1]
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


def _bf16_up(t):
    """t + one ulp in every non-zero element (a planted 1-ulp-per-element bias); f64 (oracle) unchanged."""
    if t.dtype != torch.bfloat16:
        return t
    bits = t.view(torch.int16)
    return torch.where(t > 0, bits + 1, torch.where(t < 0, bits - 1, bits)).view(torch.bfloat16)


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    d = tmp_path_factory.mktemp("golden")
    assert golden.regen(d, cases=SMALL, progress=False, out=lambda s: None) == 0
    return d


def test_check_fails_a_planted_one_ulp_bias(small_set, monkeypatch):
    """in_proj one bf16 ulp high in every element: its isolated stage fails on any CPU."""
    kp = sys.modules["ref.kda_pre"]  # the module (ref.kda_pre is the function)
    real = kp.in_proj
    monkeypatch.setattr(kp, "in_proj", lambda x, w, num: _bf16_up(real(x, w, num)))
    problems = golden.check(small_set)
    assert any("k1.tap.proj (isolated)" in p and "of elements differ" in p for p in problems), problems


@pytest.mark.parametrize("where", ["k1", "k2"])
def test_check_fails_a_changed_eps(small_set, monkeypatch, where):
    """The input (K1) or post-attention (K2) RMSNorm with its eps doubled: the quiet token of the
    synthetic carry makes it show in the isolated x."""
    mod = sys.modules["ref.kda_pre" if where == "k1" else "ref.k2_launch"]
    real = mod.rmsnorm
    monkeypatch.setattr(mod, "rmsnorm", lambda x, w, eps, num: real(x, w, 2 * eps, num))
    problems = golden.check(small_set)
    assert any(f"{where}.tap.x (isolated)" in p for p in problems), problems


def test_check_strict_is_bit_for_bit(small_set, monkeypatch):
    """One element one bf16 ulp off: inside the isolated tolerance, caught by --strict and by the
    oracle comparison."""
    real = ref.kda_pre

    def nudged(key, **kw):
        real(key, **kw)
        c = kw["core_out"]
        c[0, 0] = c[0, 0] * (1 + 2 ** -7) + (2 ** -7 if c.dtype == torch.float64 else 0)

    monkeypatch.setattr(ref, "kda_pre", nudged)
    strict = golden.check(small_set, strict=True)
    assert any("k1.exact.core_out" in p and "not bit-identical" in p for p in strict), strict
    assert any("k1.oracle.core_out" in p and "oracle max" in p for p in golden.check(small_set)), strict


def test_check_holds_under_reassociation(small_set, monkeypatch):
    """A reordered fp32 sum (one fp32 ulp on one recurrent-state element) passes the default check,
    not --strict; a 5% gain fails both."""
    real = ref.kda_pre

    def reassociated(key, **kw):
        real(key, **kw)
        rs = kw["rstate"]
        if rs.dtype == torch.float32:
            i = int(rs.abs().reshape(-1).argmax())
            rs.view(-1)[i] = torch.nextafter(rs.view(-1)[i], torch.tensor(float("inf")))

    monkeypatch.setattr(ref, "kda_pre", reassociated)
    notes = []
    assert golden.check(small_set, notes=notes) == []
    assert notes and "isolated" in notes[0]
    assert any("k1.exact.rstate" in p for p in golden.check(small_set, strict=True))

    def changed(key, **kw):
        real(key, **kw)
        kw["core_out"].mul_(1.05)

    monkeypatch.setattr(ref, "kda_pre", changed)
    assert any("k1.core_out (isolated)" in p for p in golden.check(small_set))


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


def test_concurrent_regen_refuses(small_set, capsys):
    """A second regen while one holds the lock: one line, exit 2, the set untouched."""
    import fcntl

    before = snapshot(small_set / golden.SET)
    with open(small_set / ".regen.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(InputError, match="holds the lock"):
            golden.regen(small_set, force=True, cases=SMALL, progress=False, out=lambda s: None)
        assert cli_main(["golden", "regen", "--force", "--dir", str(small_set), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lock" in err[0]
    assert snapshot(small_set / golden.SET) == before


def test_swap_is_one_atomic_exchange(tmp_path, monkeypatch):
    """The new set replaces the old by one renameat2 exchange: no moment without golden/set."""
    assert golden.regen(tmp_path, cases=SMALL, progress=False, out=lambda s: None) == 0
    seen = []
    real = golden._exchange

    def spy(a, b):
        ok = real(a, b)
        seen.append(ok)
        assert (tmp_path / golden.SET / "manifest.json").is_file()
        return ok

    monkeypatch.setattr(golden, "_exchange", spy)
    monkeypatch.setattr(golden, "SEED", golden.SEED + 3)
    assert golden.regen(tmp_path, force=True, cases=SMALL, progress=False, out=lambda s: None) == 0
    assert seen == [True] and golden.check(tmp_path) == []
    assert not list(tmp_path.glob(".set.*"))


def _rewrite_manifest(live, edit):
    import json

    man = json.loads((live / "manifest.json").read_text())
    edit(man)
    (live / "manifest.json").write_text(json.dumps(man))


def test_check_wants_exactly_the_manifest_cases(tmp_path):
    import shutil

    assert golden.regen(tmp_path, cases=SMALL, progress=False, out=lambda s: None) == 0
    live = tmp_path / golden.SET
    # an empty set is no golden set
    _rewrite_manifest(live, lambda m: m.update(cases=[]))
    with pytest.raises(InputError, match="lists no cases"):
        golden.check(tmp_path)
    shutil.rmtree(tmp_path / golden.SET)
    assert golden.regen(tmp_path, cases=SMALL, progress=False, out=lambda s: None) == 0
    # a whole capture set gone, its files dropped from the manifest too (hashes stay consistent)
    (sp,) = [p for p in live.iterdir() if p.is_dir()][0].glob("s*_l*")
    gone = {p.relative_to(live).as_posix() for p in sp.rglob("*.safetensors")}
    exp = sp.parent / "expected" / f"{sp.name}.safetensors"
    gone.add(exp.relative_to(live).as_posix())
    shutil.rmtree(sp)
    exp.unlink()
    _rewrite_manifest(live, lambda m: [m["files"].pop(f) for f in gone])
    with pytest.raises(InputError, match="is missing"):
        golden.check(tmp_path)


def test_interrupted_swap_is_named_by_check(tmp_path):
    assert golden.regen(tmp_path, cases=SMALL, progress=False, out=lambda s: None) == 0
    (tmp_path / golden.SET).rename(tmp_path / ".set.old-crash")
    with pytest.raises(InputError, match="interrupted mid-swap"):
        golden.check(tmp_path)
    assert golden.regen(tmp_path, cases=SMALL, progress=False, out=lambda s: None) == 0  # restores it
    assert golden.check(tmp_path) == []
