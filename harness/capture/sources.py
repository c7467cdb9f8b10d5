"""Where a capture's weights come from (DESIGN §8, three sources), and the per-process cache.

A capture names the weights of each launch by an *entry* (manifest `weights.k1` / `weights.k2`):

    {"source": "stored", "sha256": ADDR, "file": "../weights/ADDR.safetensors"}
        a content-addressed weight file (schema 1 entries have no "source": they are this);
    {"source": "recipe", "generator": "ref.synth", "version": 2, "seed": 0, "config": {name, dims},
     "layer": 1, "rank": 0, "world": 2, "which": "k2", "format": "mxfp4",
     "tensors": {ABI name: {"dtype", "shape", "digest"}}}
        regenerated on the replay's device by ref.synth (integer arithmetic: the same bits on
        CPU, CUDA, ROCm) and checked against the digests (harness.digest);
    {"source": "checkpoint", ...}
        tensors of a model checkpoint's safetensors shards, sliced and laid out (checkpoint.py).

Writers get entries from `stored_entry`, `recipe_source` and `checkpoint.checkpoint_source`.

Loading goes through one `WeightCache` per process: a launch's weights are loaded once per
(source, device) and shared by every capture set that names them, least recently used first
out when the bytes exceed the budget (`K3VERIFY_WEIGHT_CACHE`, e.g. `24G`, `0` = no cache;
default 24 GiB: one k3-tp8 layer of 8 ranks). Tensors are handed out as they are, never
cloned: the harness promises not to write weights.

Verification (`verify`): "once" (default) hashes a stored file once per process, keyed by
(path, size, mtime_ns, address), and checks a recipe's or checkpoint's digests each time it is
loaded into the cache; "full" re-hashes and regenerates everything, bypassing the cache;
"none" checks nothing.
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from ..digest import digest
from ..errors import InputError
from .format import (DTYPES, WEIGHTS_FORMAT, canon, dtype_name, handle, read_header, st_dtype, tensor_sha256)

SOURCES = ("stored", "recipe", "checkpoint")
WEIGHTS_SCHEMA = 1
VERIFY = ("once", "full", "none")
CACHE_ENV = "K3VERIFY_WEIGHT_CACHE"
CACHE_DEFAULT = 24 << 30


def verify_mode(verify) -> str:
    """True/False/'once'/'full'/'none' -> one of VERIFY."""
    if verify is True:
        return "once"
    if verify is False or verify is None:
        return "none"
    if verify not in VERIFY:
        raise InputError("verify", f"{verify!r} is not one of {', '.join(VERIFY)}")
    return verify


# --------------------------------------------------------------------------- stored

def weights_address(entries: dict) -> str:
    return hashlib.sha256(canon(entries).encode()).hexdigest()


def entries_of(tensors: dict) -> dict:
    return {n: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "sha256": tensor_sha256(t)}
            for n, t in sorted(tensors.items()) if t is not None}


def store_weights(root: str | os.PathLike, tensors: dict, entries: dict | None = None) -> str:
    """Write `tensors` (None values skipped) to ROOT/weights/<address>.safetensors unless it
    exists; return the address. `entries` (from a previous call's hashing) skips re-hashing."""
    from .writer import write_new

    entries = entries or entries_of(tensors)
    addr = weights_address(entries)
    path = Path(root) / "weights" / f"{addr}.safetensors"
    if path.exists():
        got = read_header(path).manifest()
        if got.get("address") != addr:
            raise InputError("weights", f"existing file's address {got.get('address')!r} != its name", str(path))
        return addr
    man = {"format": WEIGHTS_FORMAT, "schema": WEIGHTS_SCHEMA, "address": addr, "tensors": entries}
    data = {n: t.detach().cpu().contiguous() for n, t in tensors.items() if t is not None}
    write_new(path, data, man, exist_ok=True)
    return addr


def stored_entry(address: str, file: str | None = None) -> dict:
    """The entry naming a stored weight file (file: relative to the capture's folder)."""
    e = {"source": "stored", "sha256": address}
    if file is not None:
        e["file"] = file
    return e


class WeightHasher:
    """Caches tensor hashes by storage identity, so re-storing the same weights is cheap.

    The cache holds a reference to every tensor it hashed, so no other tensor can reuse
    its memory (and inherit its hash) while the cache lives.
    """

    def __init__(self):
        self._cache: dict[tuple, str] = {}
        self._keep: list[torch.Tensor] = []

    def entries(self, tensors: dict) -> dict:
        out = {}
        for n, t in sorted(tensors.items()):
            if t is None:
                continue
            k = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.device.type,
                 getattr(t, "_version", 0))
            if k not in self._cache:
                self._cache[k] = tensor_sha256(t)
                self._keep.append(t)
            out[n] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "sha256": self._cache[k]}
        return out


def stored_header(path: Path) -> tuple:
    """(Header, tensor entries) of a weight file, strictly checked, no data read."""
    from .validate import check_tensor_entries, check_weights_manifest

    hdr = read_header(path)
    man = hdr.manifest()
    entries = check_weights_manifest(man, hdr.where)
    if path.stem != man["address"]:
        raise InputError("address", "file name / manifest address / tensor list disagree", hdr.where)
    check_tensor_entries(hdr, entries, {})
    return hdr, entries


_VERIFIED: set[tuple] = set()
_VLOCK = threading.Lock()


def load_weights(path: str | os.PathLike, verify="once") -> dict:
    """Memory-mapped weight tensors of a stored weight file (verify: see the module docstring)."""
    path = Path(path)
    verify = verify_mode(verify)
    hdr, entries = stored_header(path)
    f = handle(hdr)
    ts = {n: f.get_tensor(n) for n in entries}
    ident = (str(path.resolve()), hdr.size, hdr.mtime_ns, path.stem)
    if verify == "full" or (verify == "once" and ident not in _VERIFIED):
        for n, e in entries.items():
            if tensor_sha256(ts[n]) != e["sha256"]:
                raise InputError(n, "sha256 mismatch: the file is corrupt or was edited", hdr.where)
        _finite(ts, "weights.", hdr.where)
        with _VLOCK:
            _VERIFIED.add(ident)
    return ts


def _finite(ts: dict, prefix: str, where: str) -> None:
    for n, t in ts.items():
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise InputError(f"{prefix}{n}", "contains NaN or Inf", where)


# --------------------------------------------------------------------------- recipe

def recipe_source(cfg, layer: int, rank: int, fmt: str | None, seed: int = 0, which: str = "k2",
                  device="cpu") -> tuple[dict, dict]:
    """(entry, tensors) of ref.synth's weights for one (layer, rank, launch): the entry names
    them by recipe (a few hundred bytes plus a digest per tensor), the tensors are the
    generated ones (on `device`), for the producer to run with."""
    from ref import synth as rsynth

    if which not in rsynth.WHICH:
        raise InputError("which", f"{which!r} is not one of {', '.join(rsynth.WHICH)}")
    ts = rsynth.weights(which, cfg, layer, rank, fmt, seed, device)
    return recipe_entry(cfg, layer, rank, fmt, seed, which, ts), ts


def recipe_entry(cfg, layer: int, rank: int, fmt: str | None, seed: int, which: str, tensors: dict) -> dict:
    """The recipe entry of weights already generated by ref.synth.weights(which, cfg, layer,
    rank, fmt, seed) (`tensors`, on any device): recipe_source without generating again."""
    from ref import synth as rsynth

    return {"source": "recipe", "generator": rsynth.GENERATOR, "version": rsynth.VERSION, "seed": int(seed),
            "config": {"name": cfg.name, "dims": cfg.dims()}, "layer": int(layer), "rank": int(rank),
            "world": int(cfg.world), "which": which, "format": fmt if which == "k2" else None,
            "tensors": {n: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "digest": digest(t)}
                        for n, t in sorted(tensors.items()) if t is not None}}


def generate(entry: dict, device, verify: str, field: str, where: str) -> dict:
    """Regenerate a (validated) recipe entry's tensors on `device`; check them against it."""
    from ref import synth as rsynth
    from ref.config import Config

    cfg = Config.from_dims(entry["config"]["dims"])
    ts = rsynth.weights(entry["which"], cfg, entry["layer"], entry["rank"], entry["format"], entry["seed"],
                        device)
    ts = {n: t for n, t in ts.items() if t is not None}
    decl = entry["tensors"]
    for n in sorted(set(ts) ^ set(decl)):
        raise InputError(f"{field}.tensors.{n}", "the generator " + ("makes it but the recipe does not list it"
                                                                     if n in ts else "does not make it"), where)
    for n, t in ts.items():
        if dtype_name(t.dtype) != decl[n]["dtype"] or list(t.shape) != decl[n]["shape"]:
            raise InputError(f"{field}.tensors.{n}", f"generated {dtype_name(t.dtype)} {list(t.shape)}, the recipe "
                                                     f"says {decl[n]['dtype']} {decl[n]['shape']}", where)
        if verify != "none" and digest(t) != decl[n]["digest"]:
            raise InputError(f"{field}.tensors.{n}.digest", "the regenerated tensor's digest differs from the "
                                                            "recorded one (another generator or platform?)", where)
    return ts


# --------------------------------------------------------------------------- dispatch

def declared(entry: dict, base: Path, field: str, where: str) -> dict:
    """{name: (dtype, shape)} an entry promises, read without loading tensor data (a stored
    file's header; a checkpoint's shard headers)."""
    src = entry["source"]
    if src == "stored":
        _, ents = stored_header(stored_path(entry, base, field, where))
        return {n: (e["dtype"], list(e["shape"])) for n, e in ents.items()}
    if src == "checkpoint":
        from .checkpoint import plan_check

        plan_check(entry, base, field, where)
    return {n: (e["dtype"], list(e["shape"])) for n, e in entry["tensors"].items()}


def stored_path(entry: dict, base: Path, field: str, where: str) -> Path:
    """The weight file a stored entry names: its `file` (relative to the capture's folder), or
    weights/<address>.safetensors in the capture's parent folders."""
    name = f"{entry['sha256']}.safetensors"
    cands = []
    if isinstance(entry.get("file"), str):
        cands.append(base / entry["file"])
    cands += [p / "weights" / name for p in [base] + list(base.parents)[:3]]
    for c in cands:
        if c.name == name and os.path.lexists(c):
            return c
    raise InputError(field, f"weight file {name} not found (looked in {cands[0].parent})", where)


def _key(entry: dict, base: Path, field: str, where: str) -> tuple:
    if entry["source"] == "stored":
        p = stored_path(entry, base, field, where)
        st = p.stat()
        return ("stored", str(p.resolve()), st.st_size, st.st_mtime_ns, entry["sha256"])
    if entry["source"] == "checkpoint":
        from .checkpoint import checkpoint_root

        return ("checkpoint", str(checkpoint_root(entry, base)), canon(entry))
    return ("recipe", canon(entry))


def _load(entry: dict, base: Path, device, verify: str, field: str, where: str) -> dict:
    src = entry["source"]
    if src == "stored":
        ts = load_weights(stored_path(entry, base, field, where), verify)
        return ts if torch.device(device).type == "cpu" else {n: t.to(device) for n, t in ts.items()}
    if src == "recipe":
        ts = generate(entry, device, verify, field, where)
    else:
        from .checkpoint import load_checkpoint

        ts = load_checkpoint(entry, base, device, verify, field, where)
    if verify != "none":
        _finite(ts, f"{field}.", where)
    return ts


def _parse_bytes(spec: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)i?B?\s*", spec, re.I)
    if not m:
        raise InputError(CACHE_ENV, f"{spec!r}: expected bytes, e.g. 24G, 500M or 0")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2).upper()]


class WeightCache:
    """LRU of loaded weight sets by (source, device) under a byte budget (see the module docstring)."""

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self._items: OrderedDict[tuple, tuple[dict, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _budget(self) -> int:
        if self.budget is not None:
            return self.budget
        spec = os.environ.get(CACHE_ENV)
        return CACHE_DEFAULT if spec is None else _parse_bytes(spec)

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self._items.values())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def get(self, entry: dict, base: Path, device, verify="once", field: str = "weights", where: str = "") -> dict:
        """The tensors of one entry on `device` (shared, read-only: do not write them)."""
        verify = verify_mode(verify)
        dev = torch.device(device)
        key = _key(entry, Path(base), field, where) + (str(dev),)
        if verify != "full":
            with self._lock:
                hit = self._items.get(key)
                if hit is not None:
                    self._items.move_to_end(key)
                    self.hits += 1
                    return dict(hit[0])
        ts = _load(entry, Path(base), dev, verify, field, where)
        size = sum(t.numel() * t.element_size() for t in ts.values() if t is not None)
        budget = self._budget()
        with self._lock:
            self.misses += 1
            self._items.pop(key, None)
            if size <= budget:
                while self._items and self.bytes + size > budget:
                    self._items.popitem(last=False)
                self._items[key] = (ts, size)
        return dict(ts)


CACHE = WeightCache()

__all__ = ["SOURCES", "VERIFY", "WeightCache", "CACHE", "WeightHasher", "weights_address", "entries_of",
           "store_weights", "stored_entry", "load_weights", "recipe_source", "recipe_entry", "generate", "declared", "stored_path",
           "verify_mode", "DTYPES", "st_dtype"]
