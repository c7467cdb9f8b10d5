"""`k3verify group DIR`: assemble a per-rank recording (the vLLM plugin's, harness/vllm_plugin.py)
into capture sets, and say what is incomplete.

    k3verify group DIR [--out DIR/sets]

DIR holds one folder a TP rank, written by that rank's worker alone::

    DIR/rank0/journal.jsonl                what the worker recorded, dropped, refused
    DIR/rank0/s00003_l002/rank0.safetensors
    DIR/rank0/weights/<address>.safetensors

Every (step, layer) that every rank recorded becomes a capture set under OUT (hard links,
or copies across file systems; weights linked into OUT/weights), validated by the strict
loader before it is put in place. Nothing under OUT is written over: a set already there
with the same files is left as it is, a different one is an error.

Problems get one line each on stderr and exit code 2 (the complete sets are still
assembled): a missing rank; a step recorded on only some ranks; a step dropped mid-step
because the byte budget ran out; a launch the recorder refused (an unknown build-key
field, a timing experiment, a layout it cannot store, …); a set the loader rejects. A
budget that stopped the recording *between* steps, and launches skipped for benign reasons
(filters, CUDA-graph segments, a K2 whose K1 took vLLM's original path) are reported on
stdout, not as problems. Exit 0 when there was none.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

from . import capture as cap
from .errors import InputError

_RANK_DIR = re.compile(r"^rank(\d+)$")
_SET = re.compile(r"^s(\d+)_l(\d+)$")


def read_journal(path: Path) -> list[dict]:
    events = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise InputError("journal", f"unreadable ({e.strerror})", str(path)) from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # a worker killed mid-line: the last line may be cut
                continue
            raise InputError(f"journal line {i}", "not JSON", str(path)) from None
        if not isinstance(ev, dict) or "event" not in ev:
            raise InputError(f"journal line {i}", "not a journal event", str(path))
        events.append(ev)
    return events


def _span(xs) -> str:
    xs = sorted(set(xs))
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _same_file(a: Path, b: Path) -> bool:
    if a.stat().st_ino == b.stat().st_ino and a.stat().st_dev == b.stat().st_dev:
        return True
    if a.stat().st_size != b.stat().st_size:
        return False
    h = [hashlib.sha256(p.read_bytes()).digest() for p in (a, b)]
    return h[0] == h[1]


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def group(root, out=None) -> dict:
    """Assemble the recording under `root`; returns {"sets": [...], "problems": [...], "notes": [...]}."""
    root = Path(root)
    if not root.is_dir():
        raise InputError("DIR", "folder not found", str(root))
    out = Path(out) if out is not None else root / "sets"
    rank_dirs = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := _RANK_DIR.match(p.name))}
    journals = {r: read_journal(p / "journal.jsonl") for r, p in rank_dirs.items()
                if (p / "journal.jsonl").is_file()}
    if not journals:
        raise InputError("DIR", "no per-rank recording here (rank*/journal.jsonl): is this a K3VERIFY_RECORD folder?",
                         str(root))
    problems, notes = [], []
    worlds = {ev.get("world") for evs in journals.values() for ev in evs if ev["event"] == "start"}
    worlds.discard(None)
    if len(worlds) > 1:
        raise InputError("journal.world", f"the ranks disagree on the world size: {sorted(worlds)}", str(root))
    world = worlds.pop() if worlds else max(journals) + 1
    for r in range(world):
        if r not in journals:
            problems.append(f"rank {r} missing: no {root / f'rank{r}' / 'journal.jsonl'} (world {world}); "
                            "none of its sets can be assembled")
    for r in sorted(set(journals) - set(range(world))):
        problems.append(f"rank {r}: beyond world {world}")

    dropped: dict[int, dict[int, str]] = {}
    for r, evs in sorted(journals.items()):
        for ev in evs:
            e = ev["event"]
            if e == "dropped":
                dropped.setdefault(ev.get("step"), {})[r] = ev.get("reason", "")
            elif e == "refused":
                problems.append(f"rank {r}: {ev.get('kernel', '?')} of layer {ev.get('layer')} not recorded: "
                                f"{ev.get('reason')}")
            elif e == "stopped":
                notes.append(f"rank {r}: recording stopped before step {ev.get('step')}: {ev.get('reason')}")
            elif e == "close" and ev.get("skipped"):
                sk = {k: v for k, v in ev["skipped"].items() if k != "refused"}
                if sk:
                    notes.append(f"rank {r}: launches not recorded: " +
                                 ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in sorted(sk.items())))
    for step, by_rank in sorted(dropped.items()):
        rs = ",".join(str(r) for r in sorted(by_rank))
        problems.append(f"step {step} dropped whole on rank(s) {rs}: {next(iter(by_rank.values()))}")

    # which rank holds which (step, layer)
    have: dict[tuple[int, int], dict[int, Path]] = {}
    for r, d in sorted(rank_dirs.items()):
        if r not in journals or r >= world:
            continue
        for s in d.iterdir():
            m = _SET.match(s.name)
            f = s / f"rank{r}.safetensors"
            if m and f.is_file():
                have.setdefault((int(m.group(1)), int(m.group(2))), {})[r] = f
    live = [r for r in range(world) if r in journals]
    partial: dict[tuple, list] = {}
    sets = []
    for (step, layer), files in sorted(have.items()):
        if step in dropped:
            continue
        if len(files) < world:
            if len(live) == world:  # a missing rank was said once already
                partial.setdefault((step, tuple(sorted(files))), []).append(layer)
            continue
        try:
            p = _assemble(out, step, layer, files, {r: rank_dirs[r] for r in files})
        except InputError as e:
            problems.append(f"s{step:05d}_l{layer:03d}: {e}")
            continue
        sets.append(p)
    for (step, ranks), layers in sorted(partial.items()):
        problems.append(f"step {step}: layer(s) {_span(layers)} recorded on rank(s) {','.join(map(str, ranks))} "
                        f"only (world {world}); not assembled")
    return {"sets": sets, "problems": problems, "notes": notes, "world": world, "out": out}


def _assemble(out: Path, step: int, layer: int, files: dict, dirs: dict) -> Path:
    """Link one set's rank files (and their weight files) into OUT, validated before it appears."""
    name = cap.set_dirname(step, layer)
    final = out / name
    wdir = out / "weights"
    wdir.mkdir(parents=True, exist_ok=True)
    for r, f in files.items():
        man = cap.load_capture(f, verify=False).manifest
        for which in ("k1", "k2"):
            ref = man["weights"].get(which)
            if ref is None:
                continue
            src = dirs[r] / "weights" / f"{ref['sha256']}.safetensors"
            if not src.is_file():
                raise InputError(f"weights.{which}", f"weight file {src.name} not found", str(f))
            dst = wdir / src.name
            if dst.exists():
                if not _same_file(src, dst):
                    raise InputError(f"weights.{which}", "a different file of that address is already there; "
                                                         "nothing written over it", str(dst))
            else:
                _link(src, dst)
    if final.exists():
        same = all((final / f.name).is_file() and _same_file(f, final / f.name) for f in files.values())
        if same and len(list(final.glob("rank*.safetensors"))) == len(files):
            return final
        raise InputError("out", "a different capture set is already there; nothing written over it", str(final))
    tmp = out / f".{name}.tmp{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        for f in files.values():
            _link(f, tmp / f.name)
        cap.load_set(tmp)  # strict: hashes, shapes, every rank consistent
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise InputError("arguments", message)


def cli(argv) -> int:
    p = _Parser(prog="k3verify group", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="the K3VERIFY_RECORD folder (rank*/ inside)")
    p.add_argument("--out", default=None, help="where the capture sets go (default DIR/sets)")
    a = p.parse_args(argv)
    res = group(a.dir, a.out)
    for n in res["notes"]:
        print(f"group: {n}")
    print(f"group: {len(res['sets'])} capture set(s) of world {res['world']} in {res['out']}; "
          f"{len(res['problems'])} problem(s)")
    for pr in res["problems"]:
        print(f"k3verify group: error: {pr}", file=sys.stderr)
    return 2 if res["problems"] else 0
