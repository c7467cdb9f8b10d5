"""`k3verify golden regen [--force]` / `k3verify golden check`: the golden files (DESIGN §8).

golden/set/ holds a handful of tiny synthetic capture sets (every expert format,
block-write and plain layers, KDA and MLA layers, padding requests, acceptance 1..L)
and the reference's outputs on them:

    golden/set/manifest.json                 cases, generator and reference versions, sha256 per file
    golden/set/<case>/weights/…              content-addressed weights of the case
    golden/set/<case>/s00000_l001/rank*.safetensors   captures: their k*.after.* are the exact outputs
    golden/set/<case>/expected/s00000_l001.safetensors
        r{rank}.{k1|k2}.exact.tap.<tap>      exact-mode taps
        r{rank}.{k1|k2}.oracle.<output>      oracle-mode (float64) outputs
        r{rank}.{k1|k2}.oracle.tap.<tap>     oracle-mode taps

check: the reference re-run on every capture set. By default each stage is re-run isolated,
fed the stored exact taps (harness.isolate), and judged against the stored output:
bookkeeping outputs (prefix, the written bank row, the conv cache, K2's prefix and out)
bit for bit, the rest within a stated tolerance measured over CPU code paths (ISO_* below),
so the check holds on any x86-64 CPU and still fails when one stage's formula changes.
Oracle (float64) outputs are compared chained, within 1e-12 relative. `--strict` compares the
whole exact chain bit for bit, which only the CPU that wrote the set reproduces (torch's fp32
GEMMs and vectorized reductions differ between MKL code paths and ATen CPU capabilities).
regen: under an exclusive lock (golden/.regen.lock: a concurrent regen refuses, exit 2),
builds the whole set in golden/.set.tmp-* beside the old one (a dot-folder: discovery never
enters it), prints what changed (files, tensors, by how much), refuses to replace a different
set without --force, then swaps the two folders in one atomic exchange (Linux renameat2; elsewhere
two renames, an interruption between them undone by the next regen) and removes the old one.
check also verifies that the set on disk is exactly the manifest's cases (no set missing or
extra, an expected file for each; an empty set fails).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import ref
from ref import abi

from . import capture as cap
from .errors import InputError
from .synth import synthesize

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"
SET = "set"
FORMAT = "k3verify-golden"
SCHEMA = 1
SEED = 2026
ORACLE_RTOL = 1e-12
# The default check is isolated (every stage fed the stored exact taps, harness.isolate), so
# a stage's own arithmetic is all that can differ between CPUs: torch's fp32 GEMMs (MKL picks
# kernels per CPU, MKL_CBWR) and vectorized sums/exp (ATen's CPU capability) reorder or
# re-round fp32 work. Measured with scripts/golden_spread.py over MKL_CBWR=AVX512|AVX2|SSE4_2|
# COMPATIBLE and ATEN_CPU_CAPABILITY=avx512|avx2|default on an Intel Xeon with AMX
# (2026-12-02): bf16 stage outputs moved by at most 1 ulp in at most 0.39% of their elements
# (k1 o); fp32 ones by at most 4.5 ulps of max(|x|, rms) (k2 logits). The limits sit at 5x
# and 3.5x those; a formula change moves most elements of its stage (1 ulp everywhere, or a
# norm's eps on the quiet rows of ref.synth.carry). The regenerated set (router twins, a8w4,
# world 4) was re-checked on an AMD EPYC (2026-12-03): tests/test_golden.py passes under the
# four MKL_CBWR paths and ATEN_CPU_CAPABILITY=avx2|default.
ISO_BF16_ULPS = 1.0  # per element, ulp of max(|x|, 2^-8 rms) (harness.metrics.bf16_ulp)
ISO_BF16_FRAC = 0.02  # elements that may differ at all
ISO_F32_ULPS = 16.0  # per element, fp32 ulps of max(|x|, rms)
EXPECTED_FORMAT = "k3verify-golden-expected"
# exact outputs on a platform other than the golden set's: max |Δ| ≤ tol · max |expected|


def platform_fingerprint() -> dict:
    """What bit-exactness of the CPU reference depends on."""
    import platform

    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine()}


@dataclass(frozen=True)
class Case:
    experts: str
    layers: str
    steps: int
    num_spec: int
    requests: int
    padding: int
    num_acc: tuple
    world: int | None = None  # None: the config's

    @property
    def name(self) -> str:
        return f"{self.experts}-l{self.layers}" + (f"-w{self.world}" if self.world else "")


# tiny layers 0-5: 0 dense (K1 only), 2, 4 block-write KDA, 1 plain KDA, 3, 5 MLA (K2 only).
# Together the cases hold every L (1..4) with full and zero-extra acceptance, padding rows with
# null slot 0 and -1, every expert format, world 2 and 4 (rank order not commutative), and the
# synthetic router twins (exact key ties, at the top-k boundary too: ref.synth).
CASES = (
    Case("mxfp4", "0-1", 1, 1, 4, 1, ((1, 2, 2, 1),)),  # L 2: a = 1 and 2, a padding row
    Case("int4", "2-3", 2, 3, 2, 0, ((1, 4), (3, 2))),  # L 4: a = 1..4 over two steps
    Case("bf16", "1", 2, 2, 2, 1, ((3, 1), (1, 1))),  # L 3: a = 3 then 1, padding slot 0 then -1
    Case("a8w4", "3-4", 1, 3, 2, 0, ((4, 1),), world=4),  # L 4, world 4
    Case("mxfp4", "4", 1, 0, 3, 1, ((1, 1, 1),)),  # L 1
)
# K2 results identical on every rank: the expected files store them once, as "rep.".
REPLICATED = ("prefix", "out", "tap.delta", "tap.x", "tap.logits", "tap.topk_ids", "tap.topk_w", "tap.lat",
              "tap.ln")


def _file_sha(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- reference runs

def run_reference(cs: cap.CaptureSet) -> dict:
    """Exact and oracle reference runs of one capture set -> {tensor name: tensor} (CPU).

    Exact outputs are keyed r{r}.{k}.exact.<name>, taps r{r}.{k}.exact.tap.<tap>; oracle alike.
    K2 runs on the captured K2 inputs (isolated from K1)."""
    out = {}
    for mode in ("exact", "oracle"):
        if cs.has_k1:
            for r in cs.ranks:
                a = cs.k1_args(r)
                if mode == "oracle":
                    a = ref.upcast(a)
                taps = {}
                ref.kda_pre(cs.k1_key, **a, taps=taps, mode=mode)
                for n in cap.K1_AFTER:
                    out[f"r{r}.k1.{mode}.{n}"] = a[n]
                for n, t in taps.items():
                    out[f"r{r}.k1.{mode}.tap.{n}"] = t
        if not cs.has_k2:
            continue
        ranks = cs.k2_world_args()
        if mode == "oracle":
            ranks = [ref.upcast(a) for a in ranks]
        for a in ranks:
            a["taps"] = {}
        ref.k2_world(cs.k2_key, ranks, mode=mode)
        for r, a in enumerate(ranks):
            for n in ("prefix", "out"):
                out[f"r{r}.k2.{mode}.{n}"] = a[n]
            for n, t in a["taps"].items():
                out[f"r{r}.k2.{mode}.tap.{n}"] = t
    return {n: t.detach().cpu().contiguous() for n, t in out.items()}


def _expected_subset(res: dict) -> dict:
    """What an expected file stores: exact taps (exact outputs live in the captures) and oracle
    outputs and taps, K1's bank excepted (its one written row is the prefix); replicated K2
    results once, as rep.k2.<mode>.<name>."""
    out = {}
    for n, t in res.items():
        rank, k, mode, name = n.split(".", 3)
        if not (mode == "oracle" or name.startswith("tap.")) or (k, name) == ("k1", "blocks"):
            continue
        if k == "k2" and name in REPLICATED:
            if rank == "r0":
                out[f"rep.k2.{mode}.{name}"] = t
        else:
            out[n] = t
    return out


def _expected_for(name: str, world: int) -> list[str]:
    """The run_reference keys an expected tensor stands for (every rank for rep.*)."""
    if name.startswith("rep."):
        return [f"r{r}.{name[4:]}" for r in range(world)]
    return [name]


# --------------------------------------------------------------------------- build

def build(dest: Path, cases=CASES, progress: bool = True) -> None:
    """Write a complete golden set into the (new) folder dest."""
    files = {}
    for case in cases:
        root = dest / case.name
        sets = synthesize("tiny", case.layers, case.steps, case.num_spec, case.experts, SEED, root,
                          requests=case.requests, padding=case.padding, world=case.world, num_acc=[list(a) for a in case.num_acc],
                          progress=progress, git=False, tool="k3verify golden")
        for sp in sets:
            cs = cap.load_set(sp)
            exp = _expected_subset(run_reference(cs))
            path = root / "expected" / f"{sp.name}.safetensors"
            man = {"format": EXPECTED_FORMAT, "schema": SCHEMA, "set": sp.name,
                   "tensors": {n: {"dtype": cap.dtype_name(t.dtype), "shape": list(t.shape)} for n, t in exp.items()}}
            cap._write_new(path, exp, man)
    for p in sorted(dest.rglob("*.safetensors")):
        files[p.relative_to(dest).as_posix()] = _file_sha(p)
    manifest = {"format": FORMAT, "schema": SCHEMA, "seed": SEED, "config": "tiny",
                "cases": [dict(asdict(c), name=c.name) for c in cases],
                "generator": {"tool": "k3verify golden", "versions": cap.versions(), "git": cap.git_revision()},
                "reference": {"version": getattr(ref, "__version__", None), "oracle_rtol": ORACLE_RTOL},
                "platform": platform_fingerprint(),
                "files": files}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- diff

def _tensors(p: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    _, man = cap._read_header(p)
    return load_file(str(p)), man


def _delta(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{cap.dtype_name(b.dtype)} {list(b.shape)} -> {cap.dtype_name(a.dtype)} {list(a.shape)}"
    ne = ~cap.same_bits(a, b)
    n = int(ne.sum())
    if a.is_floating_point():
        d = (a.double() - b.double()).abs()
        d = d[ne & torch.isfinite(d)]
        mx = f", max |Δ| {float(d.max()):.3g}" if d.numel() else ""
        rel = float(d.max() / b.double().abs().max().clamp_min(1e-300)) if d.numel() else 0.0
        return f"{n}/{a.numel()} elements differ{mx} (rel {rel:.2g})"
    return f"{n}/{a.numel()} elements differ"


def diff(old: Path, new: Path) -> list[str]:
    """Human-readable changes from the golden set `old` to `new` (empty: identical content)."""
    out = []
    fo = {p.relative_to(old).as_posix() for p in old.rglob("*.safetensors")}
    fn = {p.relative_to(new).as_posix() for p in new.rglob("*.safetensors")}
    out += [f"removed  {f}" for f in sorted(fo - fn)]
    out += [f"added    {f}" for f in sorted(fn - fo)]
    for f in sorted(fo & fn):
        if _file_sha(old / f) == _file_sha(new / f):
            continue
        (to, mo), (tn, mn) = _tensors(old / f), _tensors(new / f)
        for n in sorted(set(to) - set(tn)):
            out.append(f"changed  {f}  {n}: removed")
        for n in sorted(set(tn) - set(to)):
            out.append(f"changed  {f}  {n}: added")
        for n in sorted(set(to) & set(tn)):
            if to[n].shape != tn[n].shape or to[n].dtype != tn[n].dtype or not bool(cap.same_bits(tn[n], to[n]).all()):
                out.append(f"changed  {f}  {n}: {_delta(tn[n], to[n])}")
        keys = sorted(k for k in set(mo) | set(mn) if k not in ("tensors", "alias") and mo.get(k) != mn.get(k))
        if keys:
            out.append(f"changed  {f}  manifest fields: {', '.join(keys)}")
    try:
        mo = json.loads((old / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        mo = {}
    mn = json.loads((new / "manifest.json").read_text())
    for k in ("cases", "seed", "config", "reference", "platform"):
        if mo.get(k) != mn.get(k):
            out.append(f"changed  manifest.json  {k}: {mo.get(k)} -> {mn.get(k)}")
    vo, vn = (m.get("generator", {}).get("versions") for m in (mo, mn))
    if vo != vn:
        out.append(f"changed  manifest.json  generator versions: {vo} -> {vn}")
    return out


# --------------------------------------------------------------------------- regen / check

def _recover(gdir: Path) -> None:
    """Undo a swap interrupted between its two renames (the fallback path); drop half-built sets."""
    live = gdir / SET
    olds = sorted(gdir.glob(f".{SET}.old-*"))
    if not live.exists() and olds:
        os.rename(olds[-1], live)
        olds = olds[:-1]
    for p in olds + sorted(gdir.glob(f".{SET}.tmp-*")):
        shutil.rmtree(p, ignore_errors=True)


class _Lock:
    """An exclusive lock on golden/.regen.lock: a second regen refuses at once (exit 2)."""

    def __init__(self, gdir: Path):
        self.path = gdir / ".regen.lock"

    def __enter__(self):
        import fcntl

        self.f = open(self.path, "a+")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.f.close()
            raise InputError("golden", "another `k3verify golden regen` holds the lock; nothing written",
                             str(self.path)) from None
        return self

    def __exit__(self, *exc):
        import fcntl

        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes
    import platform

    if platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    return rc == 0


def _swap_in(gdir: Path, tmp: Path) -> None:
    """Make tmp the live set: one atomic exchange where the OS has it, else two renames (an
    interruption between them is undone by the next regen)."""
    live = gdir / SET
    if _exchange(tmp, live):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old set
        return
    old = Path(tempfile.mkdtemp(prefix=f".{SET}.old-", dir=gdir))
    os.rmdir(old)
    os.rename(live, old)
    os.rename(tmp, live)
    shutil.rmtree(old, ignore_errors=True)


def regen(gdir: Path = GOLDEN_DIR, force: bool = False, cases=CASES, progress: bool = True, out=print) -> int:
    """Rebuild golden/set; 0 when written or unchanged, 1 when refused (changes without force).
    Under an exclusive lock; the new set is built in a dot-folder beside it (never discovered)."""
    gdir = Path(gdir)
    gdir.mkdir(parents=True, exist_ok=True)
    with _Lock(gdir):
        _recover(gdir)
        live = gdir / SET
        tmp = Path(tempfile.mkdtemp(prefix=f".{SET}.tmp-", dir=gdir))
        try:
            build(tmp, cases, progress)
            if live.exists():
                changes = diff(live, tmp)
                if not changes:
                    out(f"golden: up to date ({len(json.loads((tmp / 'manifest.json').read_text())['files'])} files "
                        f"in {live})")
                    return 0
                out(f"golden: {len(changes)} change(s) against {live}:")
                for c in changes:
                    out(f"  {c}")
                if not force:
                    out("golden: refusing to overwrite without --force; nothing written")
                    return 1
                _swap_in(gdir, tmp)
            else:
                os.rename(tmp, live)
            n = len(json.loads((live / "manifest.json").read_text())["files"])
            out(f"golden: wrote {n} files to {live}")
            return 0
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def _load_manifest(live: Path) -> dict:
    mp = live / "manifest.json"
    if not live.exists() and list(live.parent.glob(f".{SET}.old-*")):
        raise InputError("golden", "a regen was interrupted mid-swap: run `k3verify golden regen` to restore the "
                                   "set", str(live))
    try:
        man = json.loads(mp.read_text())
    except FileNotFoundError:
        raise InputError("golden", "no golden set (run `k3verify golden regen`)", str(live)) from None
    except json.JSONDecodeError as e:
        raise InputError("manifest.json", f"not valid JSON ({e})", str(mp)) from None
    if man.get("format") != FORMAT or man.get("schema") != SCHEMA:
        raise InputError("manifest.json", f"format/schema {man.get('format')!r}/{man.get('schema')!r}, expected "
                                          f"{FORMAT!r}/{SCHEMA}", str(mp))
    on_disk = {p.relative_to(live).as_posix() for p in live.rglob("*.safetensors")}
    listed = set(man.get("files", {}))
    for f in sorted(listed - on_disk):
        raise InputError("files", f"{f} listed in the manifest is missing", str(mp))
    for f in sorted(on_disk - listed):
        raise InputError("files", f"{f} is not listed in the manifest", str(mp))
    for f, h in sorted(man["files"].items()):
        if _file_sha(live / f) != h:
            raise InputError("files", "sha256 differs from the golden manifest (edited since regen?)", str(live / f))
    _check_cases(live, man, str(mp))
    return man


def _check_cases(live: Path, man: dict, where: str) -> None:
    """The set on disk is exactly the manifest's cases: every case's (step, layer) sets with their
    expected files, nothing else; an empty set is no golden set."""
    cases = man.get("cases")
    if not isinstance(cases, list) or not cases:
        raise InputError("cases", "the golden manifest lists no cases", where)
    want = set()
    for c in cases:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise InputError("cases", f"malformed case {c!r}", where)
        try:
            a, _, b = str(c["layers"]).partition("-")
            layers = range(int(a), int(b or a) + 1)
            steps = range(int(c["steps"]))
        except (KeyError, TypeError, ValueError):
            raise InputError("cases", f"case {c['name']}: bad layers/steps", where) from None
        want |= {f"{c['name']}/{cap.set_dirname(t, i)}" for t in steps for i in layers}
    have = {p.relative_to(live).as_posix() for p in cap.discover(live)}
    for sp in sorted(want - have):
        raise InputError("cases", f"capture set {sp} of the manifest's cases is missing", where)
    for sp in sorted(have - want):
        raise InputError("cases", f"capture set {sp} is on disk but in no case of the manifest", where)
    for sp in sorted(want):
        case, name = sp.split("/", 1)
        if not (live / case / "expected" / f"{name}.safetensors").is_file():
            raise InputError("cases", f"{sp} has no expected file", where)


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, oracle: bool) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: {cap.dtype_name(got.dtype)} {list(got.shape)}, expected {cap.dtype_name(want.dtype)} " \
               f"{list(want.shape)}"
    tol = ORACLE_RTOL if oracle else None
    if oracle and name.endswith("topk_ids"):
        # the oracle's float64 router keys of twin experts (exact ties by construction) differ by
        # the CPU BLAS's 1-ulp column noise, which orders the tied picks; the set is what counts
        got, want = got.sort(dim=-1).values, want.sort(dim=-1).values
    if tol is not None and got.is_floating_point():
        scale = float(want.double().abs().max()) if want.numel() else 0.0
        err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
        if not err <= tol * scale:  # also catches NaN
            return f"{name}: oracle max |Δ| {err:.3g} > {tol:g} · max |expected| ({scale:.3g})"
        return None
    if not bool(cap.same_bits(got, want).all()):
        return f"{name}: not bit-identical ({_delta(got, want)})"
    return None


def stage_spread(got: torch.Tensor, want: torch.Tensor) -> dict:
    """How far an isolated float stage output is from the golden one: {"dtype", "frac" (elements
    that differ), "ulps" (worst: bf16 ulps of max(|x|, 2^-8 rms), or fp32 ulps of max(|x|, rms))}."""
    from .metrics import bf16_ulp

    g, w = got.double(), want.double()
    d = (g - w).abs()
    n = w.numel()
    out = {"dtype": cap.dtype_name(want.dtype), "frac": 0.0, "ulps": 0.0}
    if n == 0 or not bool((d > 0).any()):
        return out
    rms = float(w.pow(2).mean().sqrt())
    out["frac"] = float((d > 0).sum()) / n
    if want.dtype == torch.bfloat16:
        out["ulps"] = float((d.numpy() / bf16_ulp(w.numpy(), floor=2.0 ** -8 * rms)).max())
    else:
        ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(rms).clamp_min(1e-300))) - 23)
        out["ulps"] = float((d / ulp).max())
    return out


SPREADS: list | None = None  # set to a list to collect (name, stage_spread) of every isolated comparison


def _stage_problem(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """One isolated stage output against the golden one, within the stated CPU tolerance."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: {cap.dtype_name(got.dtype)} {list(got.shape)}, expected {cap.dtype_name(want.dtype)} " \
               f"{list(want.shape)}"
    if not got.is_floating_point():
        return None if torch.equal(got, want) else f"{name}: not equal ({_delta(got, want)})"
    if not bool(torch.isfinite(got).all()):
        return f"{name}: non-finite values"
    sp = stage_spread(got, want)
    if SPREADS is not None:
        SPREADS.append((name, sp))
    if want.dtype == torch.bfloat16:
        if sp["ulps"] > ISO_BF16_ULPS or sp["frac"] > ISO_BF16_FRAC:
            return (f"{name}: {sp['frac']:.1%} of elements differ (limit {ISO_BF16_FRAC:.0%}), worst "
                    f"{sp['ulps']:.3g} bf16 ulps (limit {ISO_BF16_ULPS:g})")
    elif sp["ulps"] > ISO_F32_ULPS:
        return f"{name}: worst {sp['ulps']:.3g} fp32 ulps of max(|x|, rms) (limit {ISO_F32_ULPS:g})"
    return None


def _stored(expected: dict, after: dict, r: int, k: str, name: str) -> torch.Tensor | None:
    """The golden exact value of one output or tap of rank r (captures hold outputs, the
    expected file taps, replicated K2 taps once as rep.)."""
    if name.startswith("tap."):
        return expected.get(f"r{r}.{k}.exact.{name}", expected.get(f"rep.{k}.exact.{name}"))
    return after.get(name)


def _isolated_problems(cs: cap.CaptureSet, expected: dict, rel: str) -> list[str]:
    """Every stage of every rank re-run fed the stored exact taps, against the stored outputs:
    bookkeeping bit-exact, the rest within the stated CPU tolerance."""
    from .isolate import k1_feed_run, k2_feed_run

    problems = []

    def judge(label, got, want, exact):
        if want is None:
            return
        p = _compare(label, got, want, False) if exact else _stage_problem(label, got, want)
        if p:
            problems.append(p)

    if cs.has_k1:
        for r in cs.ranks:
            after = cs.after(r, "k1")
            feed = {t: _stored(expected, after, r, "k1", f"tap.{t}") for t in abi.K1_TAPS}
            out, a = k1_feed_run(cs.k1_key, cs.k1_args(r), {t: v for t, v in feed.items() if v is not None})
            for n in ("prefix", "blocks", "conv_state"):  # copies and an elementwise bf16 add
                judge(f"{rel} r{r}.k1.{n}", a[n], after.get(n), True)
            for n in ("rstate", "core_out"):
                judge(f"{rel} r{r}.k1.{n} (isolated)", out[n], after.get(n), False)
            for t in abi.K1_TAPS:
                judge(f"{rel} r{r}.k1.tap.{t} (isolated)", out[t], feed[t], False)
    if cs.has_k2:
        afters = [cs.after(r, "k2") for r in cs.ranks]
        feeds = [{t: _stored(expected, afters[r], r, "k2", f"tap.{t}") for t in abi.K2_TAPS} for r in cs.ranks]
        outs, args = k2_feed_run(cs.k2_key, cs.k2_world_args(), [{t: v for t, v in f.items() if v is not None}
                                                                 for f in feeds])
        for r in cs.ranks:
            for n in ("prefix", "out"):  # a bf16 add of the fed delta; a rank-order sum of the fed fin
                judge(f"{rel} r{r}.k2.{n}", args[r][n], afters[r].get(n), True)
            for t in abi.K2_TAPS:
                judge(f"{rel} r{r}.k2.tap.{t} (isolated)", outs[r][t], feeds[r][t], t == "topk_ids")
    return problems


def check(gdir: Path = GOLDEN_DIR, progress: bool = False, strict: bool = False,
          notes: list | None = None) -> list[str]:
    """Problems found re-running the reference on the golden set ([] = all reproduced).

    Default (any x86-64 CPU): every stage isolated, fed the stored exact taps; bookkeeping
    outputs bit-exact, the rest within ISO_* (see above); the oracle (float64) chained within
    ORACLE_RTOL. strict: the exact chain bit for bit as well (the CPU that wrote the set).
    notes: if a list, receives one line saying which check ran."""
    live = Path(gdir) / SET
    man = _load_manifest(live)
    if notes is not None:
        notes.append("exact outputs: chained, bit for bit (--strict)" if strict else
                     f"exact outputs: each stage isolated; bookkeeping bit for bit, bf16 stages within "
                     f"{ISO_BF16_ULPS:g} ulp in ≤ {ISO_BF16_FRAC:.0%} of elements, fp32 within {ISO_F32_ULPS:g} "
                     f"ulps of max(|x|, rms) (CPU-independent; the golden set was written on {man.get('platform')})")
    problems = []
    paths = cap.discover(live)
    from tqdm import tqdm

    for sp in tqdm(paths, desc="golden check", file=sys.stderr, disable=not progress, leave=False):
        cs = cap.load_set(sp)
        exp_path = sp.parent / "expected" / f"{sp.name}.safetensors"
        expected, _ = _tensors(exp_path)
        got = run_reference(cs)
        rel = sp.relative_to(live).as_posix()
        for n in sorted(set(_expected_subset(got)) - set(expected)):
            problems.append(f"{rel} {n}: produced but not in the golden files (regen?)")
        for n, want in expected.items():
            for g in _expected_for(n, cs.world):
                if g not in got:
                    problems.append(f"{rel} {g}: the reference no longer produces it")
                elif ".oracle." in n or strict:
                    p = _compare(f"{rel} {g}", got[g], want, ".oracle." in n)
                    if p:
                        problems.append(p)
        if strict:
            for r in cs.ranks:
                for k in [k for k, has in (("k1", cs.has_k1), ("k2", cs.has_k2), ("dense", cs.kind == "dense"))
                          if has]:
                    for n, want in cs.after(r, k).items():
                        if k == "k2" and n == "blocks" or k == "dense":
                            continue  # K2 never writes blocks; the dense stand-in is not the reference
                        p = _compare(f"{rel} r{r}.{k}.exact.{n}", got[f"r{r}.{k}.exact.{n}"], want, False)
                        if p:
                            problems.append(p)
        else:
            problems += _isolated_problems(cs, expected, rel)
    return problems


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise InputError("arguments", message)


def cli(argv) -> int:
    p = _Parser(prog="k3verify golden", description="regenerate or check the golden files")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    r = sub.add_parser("regen", help="rebuild golden/set; shows what changed, --force to replace it")
    r.add_argument("--force", action="store_true")
    r.add_argument("--dir", default=str(GOLDEN_DIR))
    r.add_argument("-q", "--quiet", action="store_true")
    c = sub.add_parser("check", help="verify the reference still reproduces the golden outputs")
    c.add_argument("--dir", default=str(GOLDEN_DIR))
    c.add_argument("--strict", action="store_true", help="the exact chain bit for bit (only on the CPU that wrote "
                                                         "the set)")
    a = p.parse_args(argv)
    if a.cmd == "regen":
        return regen(Path(a.dir), a.force, progress=not a.quiet)
    notes = []
    problems = check(Path(a.dir), progress=True, strict=a.strict, notes=notes)
    for line in notes:
        print(f"golden check: note: {line}")
    for line in problems:
        print(f"  {line}")
    live = Path(a.dir) / SET
    if problems:
        print(f"golden check: {len(problems)} mismatch(es) in {live}")
        return 1
    how = "bit for bit" if a.strict else "stage by stage, isolated"
    print(f"golden check: the reference reproduces {len(cap.discover(live))} capture sets in {live} "
          f"(exact {how}, oracle within {ORACLE_RTOL:g})")
    return 0
