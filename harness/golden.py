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

check: the reference re-run on every capture reproduces the exact outputs and taps bit for
bit (CPU) and the oracle ones within 1e-12 relative (max |Δ| ≤ 1e-12 · max |expected|).

Bit-exactness holds on the platform that wrote the set (manifest "platform": torch version,
torch's CPU capability, machine): exact mode fixes the rounding points, not the summation
order, and torch's fp32 reductions, GEMMs and vectorized exp/log/sigmoid may differ between
torch versions and CPU code paths (seen: torch 2.11 on another x86 CPU gave fp32 states and
logits ~1e-7 apart and one bf16 output in 256 one ulp apart). On another platform `check`
says so and judges the exact outputs to RELAXED (max |Δ| ≤ tol · max |expected|; integers
still equal) unless strict=True (`--strict`).
regen: builds the whole set in golden/.set.tmp-* beside the old one, prints what changed
(files, tensors, by how much), refuses to replace a different set without --force, then
swaps by rename (old → .set.old-*, new → set, old removed). An interrupted regen leaves the
old set in place; a regen interrupted between the two renames is undone by the next run.
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

from . import capture as cap
from .errors import InputError
from .synth import synthesize

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"
SET = "set"
FORMAT = "k3verify-golden"
SCHEMA = 1
SEED = 2026
ORACLE_RTOL = 1e-12
EXPECTED_FORMAT = "k3verify-golden-expected"
# exact outputs on a platform other than the golden set's: max |Δ| ≤ tol · max |expected|
RELAXED = {torch.bfloat16: 2.0 ** -8, torch.float32: 1e-5, torch.float64: 1e-12}


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

    @property
    def name(self) -> str:
        return f"{self.experts}-l{self.layers}"


# tiny layers 0-5: 0, 2, 4 block-write KDA (0 without a pending delta), 1 plain KDA, 3, 5 plain MLA.
CASES = (
    Case("mxfp4", "0-1", 1, 1, 4, 1, ((1, 2, 2, 1),)),  # padding, acceptance 1..2
    Case("int4", "2-3", 2, 3, 2, 0, ((1, 4), (3, 2))),  # acceptance 1..4 over two steps
    Case("bf16", "1", 1, 2, 2, 1, ((2, 1),)),
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
        if cs.kind == "kda":
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
                          requests=case.requests, padding=case.padding, num_acc=[list(a) for a in case.num_acc],
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
    """Undo a swap interrupted between its two renames; drop half-built sets."""
    live = gdir / SET
    olds = sorted(gdir.glob(f".{SET}.old-*"))
    if not live.exists() and olds:
        os.rename(olds[-1], live)
        olds = olds[:-1]
    for p in olds + sorted(gdir.glob(f".{SET}.tmp-*")):
        shutil.rmtree(p, ignore_errors=True)


def regen(gdir: Path = GOLDEN_DIR, force: bool = False, cases=CASES, progress: bool = True, out=print) -> int:
    """Rebuild golden/set; 0 when written or unchanged, 1 when refused (changes without force)."""
    gdir = Path(gdir)
    gdir.mkdir(parents=True, exist_ok=True)
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
            old = Path(tempfile.mkdtemp(prefix=f".{SET}.old-", dir=gdir))
            os.rmdir(old)
            os.rename(live, old)
            os.rename(tmp, live)
            shutil.rmtree(old, ignore_errors=True)
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
    return man


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, oracle: bool, strict: bool = True) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: {cap.dtype_name(got.dtype)} {list(got.shape)}, expected {cap.dtype_name(want.dtype)} " \
               f"{list(want.shape)}"
    tol = ORACLE_RTOL if oracle else None if strict else RELAXED.get(want.dtype)
    if tol is not None and got.is_floating_point():
        scale = float(want.double().abs().max()) if want.numel() else 0.0
        err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
        if not err <= tol * scale:  # also catches NaN
            what = "oracle" if oracle else "exact (relaxed: other platform)"
            return f"{name}: {what} max |Δ| {err:.3g} > {tol:g} · max |expected| ({scale:.3g})"
        return None
    if not bool(cap.same_bits(got, want).all()):
        return f"{name}: not bit-identical ({_delta(got, want)})"
    return None


def check(gdir: Path = GOLDEN_DIR, progress: bool = False, strict: bool | None = None,
          notes: list | None = None) -> list[str]:
    """Problems found re-running the reference on the golden set ([] = all reproduced).

    strict: exact outputs bit for bit (default: when this platform is the golden set's);
    notes: if a list, receives a line when the exact comparisons were relaxed."""
    live = Path(gdir) / SET
    man = _load_manifest(live)
    here = platform_fingerprint()
    if strict is None:
        strict = man.get("platform") == here
    if not strict and notes is not None:
        notes.append(f"platform {here} differs from the golden set's {man.get('platform')}: exact outputs "
                     f"judged to max |Δ| ≤ tol · max |expected| (bf16 {RELAXED[torch.bfloat16]:g}, fp32 "
                     f"{RELAXED[torch.float32]:g}), not bit for bit")
    problems = []
    paths = cap.discover(live)
    from tqdm import tqdm

    for sp in tqdm(paths, desc="golden check", file=sys.stderr, disable=not progress, leave=False):
        cs = cap.load_set(sp)
        exp_path = sp.parent / "expected" / f"{sp.name}.safetensors"
        expected, _ = _tensors(exp_path)
        got = run_reference(cs)
        rel = sp.relative_to(live).as_posix()
        for r in cs.ranks:
            for k in ("k1", "k2") if cs.kind == "kda" else ("k2",):
                for n, want in cs.after(r, k).items():
                    if k == "k2" and n == "blocks":
                        continue  # K2 never writes blocks; the exact run's inputs are the captures'
                    p = _compare(f"{rel} r{r}.{k}.exact.{n}", got[f"r{r}.{k}.exact.{n}"], want, False, strict)
                    if p:
                        problems.append(p)
        for n, want in expected.items():
            for g in _expected_for(n, cs.world):
                if g not in got:
                    problems.append(f"{rel} {g}: the reference no longer produces it")
                    continue
                p = _compare(f"{rel} {g}", got[g], want, ".oracle." in n, strict)
                if p:
                    problems.append(p)
        for n in sorted(set(_expected_subset(got)) - set(expected)):
            problems.append(f"{rel} {n}: produced but not in the golden files (regen?)")
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
    c.add_argument("--strict", action="store_true", help="bit for bit even on another platform")
    a = p.parse_args(argv)
    if a.cmd == "regen":
        return regen(Path(a.dir), a.force, progress=not a.quiet)
    notes = []
    problems = check(Path(a.dir), progress=True, strict=True if a.strict else None, notes=notes)
    for line in notes:
        print(f"golden check: note: {line}")
    for line in problems:
        print(f"  {line}")
    live = Path(a.dir) / SET
    if problems:
        print(f"golden check: {len(problems)} mismatch(es) in {live}")
        return 1
    how = "relaxed (other platform)" if notes else "bit for bit"
    print(f"golden check: the reference reproduces {len(cap.discover(live))} capture sets in {live} "
          f"(exact {how}, oracle within {ORACLE_RTOL:g})")
    return 0
