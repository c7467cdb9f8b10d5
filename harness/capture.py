"""Captured decode steps (DESIGN §8): file format, writer, strict loader, capture sets.

One capture = one decode step of one layer on one rank: a safetensors file whose
metadata key ``k3verify`` holds the JSON manifest (schema in docs/capture-format.md).
A capture *set* is the folder holding every rank of one (step, layer)::

    ROOT/weights/<sha256>.safetensors          content-addressed weights (shared)
    ROOT/s00003_l002/rank0.safetensors         step 3, layer 2, rank 0
    ROOT/s00003_l002/rank1.safetensors

Tensors of a capture (ABI names of ref/abi.py after the prefix):

    k1.in.*     K1 inputs as the kernel saw them: prefix, delta, blocks, conv_state,
                rstate (both compacted), st_idx (original slot ids), num_acc
    k1.after.*  what the producer's K1 wrote: prefix, blocks, conv_state, rstate, core_out
    k2.in.*     K2 inputs: core, prefix, blocks (for a KDA layer what K2 saw, i.e. K1's outputs)
    k2.after.*  what the producer's K2 wrote: prefix, out (and blocks, which K2 must not change)
    state.slot_map  int64 [n]: compact slot -> original slot id (slot_map[0] = 0, the null slot)

Identical tensors are stored once (``alias`` in the manifest), so K2's inputs that are
K1's outputs cost nothing. Weights (everything of the ABI that is not state) live in
``weights/<address>.safetensors``; the address is the sha256 of the canonical JSON list
of (name, dtype, shape, sha256) of its tensors.

Replay API::

    paths = discover(root)                 # every capture-set folder under root, sorted
    cs = load_set(path)                    # strict: InputError(field, msg, where=file)
    cs.cfg, cs.layer, cs.kind, cs.step, cs.world, cs.fmt, cs.k1_key, cs.k2_key
    cs.k1_args(rank, device, layout="compact"|"full")   # fresh tensors, K1 ABI names + layer
    cs.k2_args(rank, device)               # fresh tensors, K2 ABI names + layer (no rank/comm)
    cs.k2_world_args(device)               # [k2_args(r) for every rank], for ref.k2_world
    cs.after(rank, "k1"|"k2")              # what the producer wrote ({} if it recorded no after)
    cs.untouched(rank, layout)             # Untouched: slots/positions/rows the step must not write

Outputs (``core_out``, ``out``) are filled with POISON (a NaN with a recognisable
payload); in the full layout every cache slot the capture does not carry holds
POISON_FINITE (finite, so the launches' NaN check on inputs passes). Weights on
the CPU are memory-mapped views of the weight file (no copy); treat them as read-only.

Writers never replace an existing capture (they raise InputError); weight files are
content-addressed, so an existing one is reused after its header is checked.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from ref import abi
from ref.config import Config, K2Build, KdaPreBuild, key_from_dict, key_to_dict

from .errors import InputError

FORMAT = "k3verify-capture"
WEIGHTS_FORMAT = "k3verify-weights"
SCHEMA = 1
META_KEY = "k3verify"
WEIGHT_LAYOUT = "logical"  # DESIGN §7 logical layouts, no backend pre-shuffle

K1_STATE = ("prefix", "delta", "blocks", "conv_state", "rstate", "st_idx", "num_acc")
K1_WEIGHTS = tuple(n for n, *_ in abi.K1_ARGS if n not in K1_STATE + ("core_out",))
K1_AFTER = ("prefix", "blocks", "conv_state", "rstate", "core_out")
K2_STATE = ("core", "prefix", "blocks")
K2_WEIGHTS = tuple(n for n, *_ in abi.K2_ARGS if n not in K2_STATE + ("out",))
K2_AFTER = ("prefix", "out", "blocks")

# NaN payloads: bit patterns a kernel never produces by arithmetic.
POISON_BITS = {torch.bfloat16: (torch.int16, 0x7FA5), torch.float32: (torch.int32, 0x7FA5A5A5),
               torch.float64: (torch.int64, 0x7FF5A5A5A5A5A5A5), torch.float16: (torch.int16, 0x7E5A)}

POISON_FINITE = -4242.0  # far from any real activation or state value; bf16 rounds it to -4256

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool)}
KINDS = ("kda", "mla", "dense")
K1_KINDS = ("kda", "dense")  # layers with a K1 launch (a dense layer has no K2)
_SET_RE = re.compile(r"^s(\d+)_l(\d+)$")
_RANK_RE = re.compile(r"^rank(\d+)\.safetensors$")


# --------------------------------------------------------------------------- helpers

def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the raw bytes of t in row-major order (dtype and shape are recorded apart)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    b = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(b)).hexdigest()


def poison_(t: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """Fill a tensor in place with POISON: the NaN payload for outputs, or, with `finite`, the
    value POISON_FINITE (inputs must pass the launches' NaN check); integers get all bits set."""
    if finite and t.is_floating_point():
        return t.fill_(POISON_FINITE)
    if t.dtype in POISON_BITS:
        it, bits = POISON_BITS[t.dtype]
        t.view(it).fill_(bits)
    else:
        t.fill_(255 if t.dtype == torch.uint8 else -1)
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit equality (NaN == NaN when the payloads match)."""
    if a.dtype in POISON_BITS:
        it = POISON_BITS[a.dtype][0]
        return a.contiguous().view(it) == b.contiguous().view(it)
    return a == b


def git_revision(cwd: str | os.PathLike | None = None) -> str | None:
    """`git describe --always --dirty` of the project checkout, None outside git."""
    cwd = cwd or Path(__file__).resolve().parent.parent
    try:
        r = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=cwd,
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def versions() -> dict:
    import platform

    import safetensors

    import ref

    try:
        from importlib.metadata import version

        k3 = version("k3verify")
    except Exception:  # noqa: BLE001 - not installed: read the checkout's pyproject
        k3 = _pyproject_version()
    return {"k3verify": k3, "ref": getattr(ref, "__version__", None), "torch": torch.__version__,
            "safetensors": safetensors.__version__, "python": platform.python_version()}


def _pyproject_version() -> str | None:
    p = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        m = re.search(r'^version\s*=\s*"([^"]+)"', p.read_text(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def device_name(device) -> str:
    d = torch.device(device)
    if d.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(d)}"
    return d.type


def producer(tool: str, device="cpu", git: bool = True, **extra) -> dict:
    """The manifest's producer block. No timestamps: the same run writes the same bytes."""
    return {"tool": tool, "versions": versions(), "device": device_name(device),
            "git": git_revision() if git else None, **extra}


def _canon(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


# --------------------------------------------------------------------------- slots

def slot_map_for(st_idx: torch.Tensor, qlen: int) -> torch.Tensor:
    """[R, SW] int32 -> int64 [n]: 0 (the null slot), then the sorted positive ids of st_idx[:, :L]."""
    ids = st_idx[:, :qlen].reshape(-1).cpu().to(torch.int64)
    ref_ids = torch.unique(ids[ids > 0])
    return torch.cat([torch.zeros(1, dtype=torch.int64), ref_ids])


def compact_cache(cache: torch.Tensor, slot_map: torch.Tensor) -> torch.Tensor:
    """cache [slots, ...] (any strides) -> contiguous [len(slot_map), ...] copy of those slots."""
    return cache.index_select(0, slot_map.to(cache.device)).contiguous()


def remap_st_idx(st_idx: torch.Tensor, slot_map: torch.Tensor) -> torch.Tensor:
    """Original ids -> compact ids. ≤ 0 stays; a positive id the map lacks (columns ≥ L) -> -1."""
    st = st_idx.cpu().to(torch.int64)
    lut = {int(o): c for c, o in enumerate(slot_map.tolist())}
    out = [[v if v <= 0 else lut.get(v, -1) for v in row] for row in st.tolist()]
    return torch.tensor(out, dtype=torch.int32).reshape(st_idx.shape)


def conv_layout_of(conv_state: torch.Tensor) -> str:
    """'csl': [slots, C, SL] with SL innermost; 'slc': a transposed [slots, SL, C] buffer."""
    return "slc" if conv_state.stride(1) == 1 and conv_state.stride(2) != 1 else "csl"


# --------------------------------------------------------------------------- weights

def weights_address(entries: dict) -> str:
    return hashlib.sha256(_canon(entries).encode()).hexdigest()


def _entries(tensors: dict) -> dict:
    return {n: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "sha256": tensor_sha256(t)}
            for n, t in sorted(tensors.items()) if t is not None}


def store_weights(root: str | os.PathLike, tensors: dict, entries: dict | None = None) -> str:
    """Write `tensors` (None values skipped) to ROOT/weights/<address>.safetensors unless it
    exists; return the address. `entries` (from a previous call's hashing) skips re-hashing."""
    entries = entries or _entries(tensors)
    addr = weights_address(entries)
    wdir = Path(root) / "weights"
    path = wdir / f"{addr}.safetensors"
    if path.exists():
        got = _read_header(path)[1]
        if got.get("address") != addr:
            raise InputError("weights", f"existing file's address {got.get('address')!r} != its name", str(path))
        return addr
    wdir.mkdir(parents=True, exist_ok=True)
    man = {"format": WEIGHTS_FORMAT, "schema": SCHEMA, "address": addr, "tensors": entries}
    data = {n: t.detach().cpu().contiguous() for n, t in tensors.items() if t is not None}
    _write_new(path, data, man, exist_ok=True)
    return addr


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


# --------------------------------------------------------------------------- low-level file io

def _write_new(path: Path, tensors: dict, manifest: dict, exist_ok: bool = False) -> None:
    """Write a safetensors file without ever replacing an existing one (link, then unlink tmp)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={META_KEY: _canon(manifest)})
        os.chmod(tmp, 0o666 & ~_umask())
        try:
            os.link(tmp, path)
        except FileExistsError:
            if not exist_ok:
                raise InputError("out", "a capture already exists here; nothing written over it", str(path))
    finally:
        os.unlink(tmp)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _read_header(path: Path) -> tuple[dict, dict]:
    """(safetensors header, manifest) with truncation/corruption checks -> InputError."""
    where = str(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError("file", f"truncated: {size} bytes, no safetensors header", where)
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise InputError("file", f"truncated or corrupt: header of {n} bytes in a {size}-byte file", where)
            raw = f.read(n)
    except FileNotFoundError:
        raise InputError("file", "not found", where) from None
    except IsADirectoryError:
        raise InputError("file", "is a directory", where) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError("file", f"corrupt safetensors header ({e})", where) from None
    if not isinstance(header, dict):
        raise InputError("file", "corrupt safetensors header (not an object)", where)
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"
               and isinstance(v, dict) and "data_offsets" in v), default=0)
    if 8 + n + end > size:
        raise InputError("file", f"truncated: data needs {8 + n + end} bytes, file has {size}", where)
    meta = header.get("__metadata__") or {}
    if META_KEY not in meta:
        raise InputError("manifest", f"no {META_KEY!r} manifest in the safetensors metadata", where)
    try:
        man = json.loads(meta[META_KEY])
    except json.JSONDecodeError as e:
        raise InputError("manifest", f"not valid JSON ({e})", where) from None
    if not isinstance(man, dict):
        raise InputError("manifest", "not a JSON object", where)
    return header, man


@functools.lru_cache(maxsize=64)
def _open(path: str, mtime_ns: int, size: int):
    from safetensors import safe_open

    return safe_open(path, framework="pt", device="cpu")


def _handle(path: Path):
    st = path.stat()
    try:
        return _open(str(path), st.st_mtime_ns, st.st_size)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise InputError("file", f"unreadable safetensors file ({e})", str(path)) from None


def _check_schema(man: dict, fmt: str, where: str) -> None:
    if man.get("format") != fmt:
        raise InputError("manifest.format", f"{man.get('format')!r}, expected {fmt!r}", where)
    if man.get("schema") != SCHEMA:
        raise InputError("manifest.schema", f"unknown schema version {man.get('schema')!r} "
                                            f"(this k3verify reads version {SCHEMA})", where)


def _load_tensors(path: Path, header: dict, entries: dict, alias: dict, verify: bool = True) -> dict:
    """Memory-mapped tensors of a file, checked against the manifest entries."""
    where = str(path)
    stored = {k for k in header if k != "__metadata__"}
    for name in stored - set(entries):
        raise InputError(name, "tensor in the file but not in the manifest", where)
    f = _handle(path)
    out = {}
    for name, e in entries.items():
        if not isinstance(e, dict) or not {"dtype", "shape", "sha256"} <= set(e):
            raise InputError(f"manifest.tensors.{name}", "needs dtype, shape and sha256", where)
        src = alias.get(name, name)
        if src not in stored:
            raise InputError(name, "listed in the manifest but missing from the file"
                             + (f" (alias of {src})" if src != name else ""), where)
        h = header[src]
        if h["dtype"] != _st_dtype(e["dtype"]) or list(h["shape"]) != list(e["shape"]):
            raise InputError(name, f"file has {h['dtype']} {h['shape']}, manifest says {e['dtype']} {e['shape']}",
                             where)
        out[name] = out[src] if src in out else f.get_tensor(src)
        if dtype_name(out[name].dtype) != e["dtype"]:
            raise InputError(name, f"dtype {dtype_name(out[name].dtype)}, manifest says {e['dtype']}", where)
    if verify:
        for name, e in entries.items():
            if tensor_sha256(out[name]) != e["sha256"]:
                raise InputError(name, "sha256 mismatch: the file is corrupt or was edited", where)
    return out


_ST = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "uint8": "U8", "int8": "I8",
       "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL"}


def _st_dtype(name: str) -> str:
    return _ST.get(name, name)


_VERIFIED: set[tuple] = set()


def load_weights(path: Path, verify: bool = True) -> dict:
    """Memory-mapped weight tensors of a weight file; hashes checked once per process."""
    header, man = _read_header(path)
    _check_schema(man, WEIGHTS_FORMAT, str(path))
    entries = man.get("tensors") or {}
    if man.get("address") != weights_address(entries) or path.stem != man.get("address"):
        raise InputError("address", f"file name / manifest address / tensor list disagree", str(path))
    st = path.stat()
    ident = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    todo = verify and ident not in _VERIFIED
    ts = _load_tensors(path, header, entries, {}, verify=todo)
    if todo:
        for n, t in ts.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise InputError(f"weights.{n}", "contains NaN or Inf", str(path))
        _VERIFIED.add(ident)
    return ts


# --------------------------------------------------------------------------- writer

def set_dirname(step: int, layer: int) -> str:
    return f"s{step:05d}_l{layer:03d}"


def capture_path(root, step: int, layer: int, rank: int) -> Path:
    return Path(root) / set_dirname(step, layer) / f"rank{rank}.safetensors"


@dataclass
class StepRecord:
    """Everything one capture holds, before it is written. Caches are given compact."""

    step: int
    layer: int
    rank: int
    world: int
    kind: str  # kda | mla | dense
    fmt: str
    k2_key: K2Build | None  # None for a dense layer (no K2)
    k2_in: dict | None  # core, prefix, blocks
    k2_weights: str | None  # weight address
    k2_after: dict | None = None
    k1_key: KdaPreBuild | None = None
    dense_after: dict | None = None  # dense layer: {"out": MLP output (next layer's delta), "prefix"}
    k1_in: dict | None = None  # prefix, delta, blocks, conv_state, rstate (compact), st_idx (orig), num_acc
    k1_weights: str | None = None
    k1_after: dict | None = None
    slot_map: torch.Tensor | None = None
    conv_slots: int | None = None  # slot counts of the original caches
    rec_slots: int | None = None
    conv_layout: str = "csl"
    cfg: Config | None = None
    dims: dict | None = None  # when cfg is None: dims inferred from the tensors
    meta: dict = field(default_factory=dict)


def write_capture(root, rec: StepRecord, producer_info: dict) -> Path:
    """Write one capture file; refuse to replace an existing one. Returns its path."""
    path = capture_path(root, rec.step, rec.layer, rec.rank)
    if path.exists():
        raise InputError("out", "a capture already exists here; nothing written over it", str(path))
    if rec.kind not in KINDS:
        raise ValueError(f"kind: {rec.kind!r}")
    groups = []
    if rec.kind in K1_KINDS:
        groups += [("k1.in.", rec.k1_in), ("k1.after.", rec.k1_after)]
    if rec.kind == "dense":
        groups += [("dense.after.", rec.dense_after)]
    else:
        groups += [("k2.in.", rec.k2_in), ("k2.after.", rec.k2_after)]
    named: list[tuple[str, torch.Tensor]] = []
    for prefix, d in groups:
        for n, t in (d or {}).items():
            if t is not None:
                named.append((prefix + n, t.detach().cpu().contiguous()))
    if rec.kind in K1_KINDS:
        named.append(("state.slot_map", rec.slot_map.to(torch.int64).cpu().contiguous()))
    entries, alias, data, seen = {}, {}, {}, {}
    for name, t in named:
        e = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "sha256": tensor_sha256(t)}
        entries[name] = e
        k = (e["dtype"], tuple(e["shape"]), e["sha256"])
        if k in seen:
            alias[name] = seen[k]
        else:
            seen[k] = name
            data[name] = t
    rel = os.path.relpath(Path(root) / "weights", path.parent)
    wref = lambda a: None if a is None else {"sha256": a, "file": f"{rel}/{a}.safetensors"}  # noqa: E731
    man = {
        "format": FORMAT, "schema": SCHEMA,
        "layer": rec.layer, "kind": rec.kind, "step": rec.step, "rank": rec.rank, "world": rec.world,
        "config": {"name": rec.cfg.name if rec.cfg else None,
                   "dims": rec.cfg.dims() if rec.cfg else (rec.dims or {})},
        "k1_key": key_to_dict(rec.k1_key) if rec.k1_key is not None else None,
        "k2_key": key_to_dict(rec.k2_key) if rec.k2_key is not None else None,
        "experts": rec.fmt, "weight_layout": WEIGHT_LAYOUT,
        "producer": producer_info,
        "weights": {"k1": wref(rec.k1_weights), "k2": wref(rec.k2_weights)},
        "tensors": entries, "alias": alias,
        "state": None if rec.kind == "mla" else {
            "slot_map": "state.slot_map", "conv_slots": rec.conv_slots, "rec_slots": rec.rec_slots,
            "conv_layout": rec.conv_layout},
        "meta": rec.meta,
    }
    _write_new(path, data, man)
    return path


# --------------------------------------------------------------------------- loader

@dataclass
class Capture:
    """One loaded, verified capture file (tensors are memory-mapped, never modified)."""

    path: Path
    manifest: dict
    tensors: dict

    @property
    def where(self) -> str:
        return str(self.path)

    def group(self, prefix: str) -> dict:
        return {n[len(prefix):]: t for n, t in self.tensors.items() if n.startswith(prefix)}


_REQUIRED = {"layer": int, "kind": str, "step": int, "rank": int, "world": int, "config": dict,
             "experts": str, "weight_layout": str, "producer": dict, "weights": dict, "tensors": dict}


def load_capture(path: str | os.PathLike, verify: bool = True) -> Capture:
    """Read and verify one capture file (header, schema, manifest fields, tensor hashes)."""
    path = Path(path)
    where = str(path)
    header, man = _read_header(path)
    _check_schema(man, FORMAT, where)
    for k, ty in _REQUIRED.items():
        if not isinstance(man.get(k), ty) or (ty is int and isinstance(man.get(k), bool)):
            raise InputError(f"manifest.{k}", f"missing or not a {ty.__name__}", where)
    if man["kind"] not in KINDS:
        raise InputError("manifest.kind", f"{man['kind']!r} is not one of {', '.join(KINDS)}", where)
    if man["kind"] != "dense" and not isinstance(man.get("k2_key"), dict):
        raise InputError("manifest.k2_key", "missing or not a dict", where)
    if man["weight_layout"] != WEIGHT_LAYOUT:
        raise InputError("manifest.weight_layout", f"{man['weight_layout']!r}, this loader reads "
                                                   f"{WEIGHT_LAYOUT!r}", where)
    if man["world"] not in (1, 2, 4, 8) or not 0 <= man["rank"] < man["world"]:
        raise InputError("manifest.rank", f"rank {man['rank']} / world {man['world']} invalid", where)
    alias = man.get("alias") or {}
    if not isinstance(alias, dict):
        raise InputError("manifest.alias", "not an object", where)
    tensors = _load_tensors(path, header, man["tensors"], alias, verify=verify)
    return Capture(path, man, tensors)


@dataclass
class Untouched:
    """What a step must not write, in one layout ('compact' or 'full').

    conv_slots / rstate_slots: whole slots that must come back bit-identical;
    conv_written: the conv slots the step writes, whose positions [conv_keep_from, SL)
    must not change; k1_block_rows: bank rows K1 must not write (K2 writes none).
    """

    layout: str
    conv_slots: list[int]
    conv_written: list[int]
    conv_keep_from: int
    rstate_slots: list[int]
    k1_block_rows: list[int]
    shapes: dict  # name -> logical shape of the tensors the masks apply to

    def masks(self) -> dict:
        """name -> bool mask (True = must not change), broadcastable to the tensor."""
        cs, rs, bl = self.shapes["conv_state"], self.shapes["rstate"], self.shapes["blocks"]
        conv = torch.zeros(cs[0], 1, cs[2], dtype=torch.bool)
        conv[self.conv_slots] = True
        if self.conv_written:
            conv[self.conv_written, :, self.conv_keep_from:] = True
        rst = torch.zeros(rs[0], 1, 1, 1, dtype=torch.bool)
        rst[self.rstate_slots] = True
        rows = torch.zeros(1, bl[1], 1, dtype=torch.bool)
        rows[:, self.k1_block_rows] = True
        return {"conv_state": conv.expand(cs), "rstate": rst.expand(rs), "blocks": rows.expand(bl)}

    def violations(self, before: dict, after: dict) -> dict:
        """name -> number of protected elements whose bits changed (only names with changes)."""
        out = {}
        for name, m in self.masks().items():
            if name in before and name in after:
                bad = int((~same_bits(before[name], after[name]).cpu() & m).sum())
                if bad:
                    out[name] = bad
        return out


class CaptureSet:
    """All ranks of one (step, layer), loaded and validated. See the module docstring."""

    def __init__(self, path: Path, caps: list[Capture], weights: list[dict]):
        self.path = path
        self.captures = caps
        self._weights = weights  # per rank {"k1": {...}|None, "k2": {...}}
        m = caps[0].manifest
        self.manifest = m
        self.layer, self.kind, self.step, self.world = m["layer"], m["kind"], m["step"], m["world"]
        self.fmt = m["experts"]
        self.config_name = m["config"].get("name")
        try:
            dims = m["config"]["dims"]
            self.cfg: Config | None = Config.from_dims(dims) if self.config_name is not None else None
        except (KeyError, TypeError, ValueError) as e:
            raise InputError("manifest.config", f"bad config dims ({e!r})", caps[0].where) from None
        for fld, cls in (("k1_key", KdaPreBuild), ("k2_key", K2Build)):
            try:
                setattr(self, fld, key_from_dict(cls, m[fld]) if m.get(fld) else None)
            except (KeyError, TypeError) as e:
                raise InputError(f"manifest.{fld}", f"bad build key ({e!r})", caps[0].where) from None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def ranks(self) -> range:
        return range(self.world)

    def weights(self, rank: int, which: str, device="cpu") -> dict:
        """Memory-mapped weights of one rank ('k1' or 'k2'); moved to `device` if not the CPU."""
        w = self._weights[rank][which] or {}
        if torch.device(device).type == "cpu":
            return dict(w)
        return {n: t.to(device) for n, t in w.items()}

    # ---- state rebuild
    def _state(self, rank: int) -> dict:
        s = self.captures[rank].manifest["state"]
        return s

    def k1_args(self, rank: int, device="cpu", layout: str = "compact", poison: bool = True) -> dict:
        """Fresh K1 launch kwargs (ABI names + layer): caches rebuilt in `layout`, core_out poisoned.

        compact: caches hold the carried slots only (slot i = slot_map[i]), st_idx remapped;
        full: caches of the original slot counts, st_idx as captured, other slots POISON_FINITE.
        """
        if self.kind not in K1_KINDS:
            raise InputError("kind", f"layer {self.layer} is an MLA layer: it has no K1 launch", str(self.path))
        cap = self.captures[rank]
        st = self._state(rank)
        g = cap.group("k1.in.")
        smap = cap.tensors["state.slot_map"]
        a = {n: (g[n].to(device, copy=True) if g.get(n) is not None else None)
             for n in ("prefix", "delta", "blocks", "num_acc")}
        a.setdefault("delta", None)
        conv_c, rs_c = g["conv_state"], g["rstate"]
        if layout == "compact":
            conv, rs = conv_c.clone(), rs_c.clone()
            st_idx = remap_st_idx(g["st_idx"], smap)
        elif layout == "full":
            conv = torch.empty((st["conv_slots"],) + tuple(conv_c.shape[1:]), dtype=conv_c.dtype)
            rs = torch.empty((st["rec_slots"],) + tuple(rs_c.shape[1:]), dtype=rs_c.dtype)
            if poison:
                poison_(conv, finite=True), poison_(rs, finite=True)
            else:
                conv.zero_(), rs.zero_()
            conv[smap] = conv_c
            rs[smap] = rs_c
            st_idx = g["st_idx"].clone()
        else:
            raise ValueError(f"layout: {layout!r} is neither compact nor full")
        if st["conv_layout"] == "slc":  # rebuild the transposed buffer the kernel saw
            conv = conv.to(device).transpose(1, 2).contiguous().transpose(1, 2)
        a.update(conv_state=conv.to(device), rstate=rs.to(device), st_idx=st_idx.to(device))
        a.update(self.weights(rank, "k1", device))
        core = torch.empty(g["prefix"].shape[0], conv_c.shape[1] // 3, dtype=g["prefix"].dtype, device=device)
        a["core_out"] = poison_(core) if poison else core.zero_()
        a["layer"] = self.layer
        return {n: a[n] for n in abi.K1_NAMES}

    def k2_args(self, rank: int, device="cpu", poison: bool = True) -> dict:
        """Fresh K2 launch kwargs (ABI names + layer; the caller adds rank and comm), out poisoned."""
        if self.kind == "dense":
            raise InputError("kind", f"layer {self.layer} is a dense-MLP layer: it has no K2 launch", str(self.path))
        cap = self.captures[rank]
        g = cap.group("k2.in.")
        a = {n: g[n].to(device, copy=True) for n in K2_STATE}
        a.update(self.weights(rank, "k2", device))
        a.setdefault("w13s", None)
        a.setdefault("w2s", None)
        out = torch.empty_like(a["prefix"])
        a["out"] = poison_(out) if poison else out.zero_()
        a["layer"] = self.layer
        return {n: a[n] for n in abi.K2_NAMES if n not in ("rank", "comm")}

    def k2_world_args(self, device="cpu") -> list[dict] | None:
        """Every rank's K2 args (None for a dense layer)."""
        if self.kind == "dense":
            return None
        return [self.k2_args(r, device) for r in self.ranks]

    @property
    def has_k1(self) -> bool:
        return self.kind in K1_KINDS

    @property
    def has_k2(self) -> bool:
        return self.kind != "dense"

    def after(self, rank: int, which: str) -> dict:
        """What the producer's kernel wrote: 'k1' (prefix, blocks, conv_state, rstate compact,
        core_out) or 'k2' (prefix, out, blocks). {} when the producer recorded none."""
        if which not in ("k1", "k2", "dense"):
            raise ValueError(f"which: {which!r}")
        return dict(self.captures[rank].group(f"{which}.after."))

    def inputs(self, rank: int, which: str) -> dict:
        """The stored input tensors of one launch (memory-mapped, caches compact)."""
        return dict(self.captures[rank].group(f"{which}.in."))

    def untouched(self, rank: int, layout: str = "compact") -> Untouched:
        """Slots/positions/rows the K1 launch must leave bit-identical (DESIGN §5 exactness)."""
        if self.kind not in K1_KINDS:
            raise InputError("kind", f"layer {self.layer} is an MLA layer: no K1 state", str(self.path))
        cap = self.captures[rank]
        g = cap.group("k1.in.")
        smap = cap.tensors["state.slot_map"].tolist()
        st = self._state(rank)
        L, W = self.k1_key.qlen, self._weights[rank]["k1"]["conv_w"].shape[1]
        idx = g["st_idx"][:, :L].tolist()
        na = g["num_acc"].tolist()
        conv_w = sorted({row[0] for row in idx if row[0] > 0})
        rs_w = sorted({v for row, a in zip(idx, na) if row[a - 1] > 0 for v in row if v > 0})
        if layout == "compact":
            pos = {o: c for c, o in enumerate(smap)}
            conv_w, rs_w = [pos[s] for s in conv_w], [pos[s] for s in rs_w]
            n_conv = n_rs = len(smap)
        else:
            n_conv, n_rs = st["conv_slots"], st["rec_slots"]
        cs = (n_conv,) + tuple(g["conv_state"].shape[1:])
        rs = (n_rs,) + tuple(g["rstate"].shape[1:])
        bl = tuple(g["blocks"].shape)
        wi = self.k1_key.write_idx
        return Untouched(layout=layout, conv_slots=sorted(set(range(n_conv)) - set(conv_w)), conv_written=conv_w,
                         conv_keep_from=W - 2 + L, rstate_slots=sorted(set(range(n_rs)) - set(rs_w)),
                         k1_block_rows=[b for b in range(bl[1]) if b != wi],
                         shapes={"conv_state": cs, "rstate": rs, "blocks": bl})


# --------------------------------------------------------------------------- set loading + validation

def _weights_path(cap: Capture, which: str) -> Path | None:
    ref = cap.manifest["weights"].get(which)
    if ref is None:
        return None
    if not isinstance(ref, dict) or not isinstance(ref.get("sha256"), str):
        raise InputError(f"manifest.weights.{which}", "needs sha256", cap.where)
    name = f"{ref['sha256']}.safetensors"
    cands = []
    if isinstance(ref.get("file"), str):
        cands.append(cap.path.parent / ref["file"])
    cands += [p / "weights" / name for p in list(cap.path.parents)[:4]]
    for c in cands:
        if c.name == name and c.is_file():
            return c
    raise InputError(f"weights.{which}", f"weight file {name} not found (looked in {cands[0].parent})", cap.where)


def discover(root: str | os.PathLike) -> list[Path]:
    """Every capture-set folder (holding rank*.safetensors) under root, sorted; root itself if it is one."""
    root = Path(root)
    if not root.exists():
        raise InputError("captures", "folder not found", str(root))
    if root.is_file():
        return [root.parent]
    found = {p.parent for p in root.rglob("rank*.safetensors") if _RANK_RE.match(p.name)
             and "weights" not in p.relative_to(root).parts}
    return sorted(found, key=lambda p: (str(p.parent), _set_order(p)))


def _set_order(p: Path):
    m = _SET_RE.match(p.name)
    return (0, int(m.group(1)), int(m.group(2))) if m else (1, 0, 0)


_CONSISTENT = ("layer", "kind", "step", "world", "config", "k1_key", "k2_key", "experts", "weight_layout")


def load_set(path: str | os.PathLike, verify: bool = True, verify_weights: bool = True) -> CaptureSet:
    """Load every rank of one capture set and validate it (DESIGN §8); InputError on any defect."""
    path = Path(path)
    if path.is_file():
        path = path.parent
    if not path.is_dir():
        raise InputError("captures", "capture-set folder not found", str(path))
    files = {}
    for p in path.iterdir():
        m = _RANK_RE.match(p.name)
        if m:
            files[int(m.group(1))] = p
    if not files:
        raise InputError("captures", "no rank*.safetensors in this folder", str(path))
    first = load_capture(files[min(files)], verify)
    world = first.manifest["world"]
    missing = [r for r in range(world) if r not in files]
    if missing:
        raise InputError("rank", f"missing rank(s) {missing} of world {world}", str(path))
    extra = sorted(r for r in files if r >= world)
    if extra:
        raise InputError("rank", f"rank file(s) {extra} beyond world {world}", str(path))
    caps = [first if r == min(files) else load_capture(files[r], verify) for r in range(world)]
    for r, c in enumerate(caps):
        if c.manifest["rank"] != r:
            raise InputError("manifest.rank", f"{c.manifest['rank']} in file rank{r}.safetensors", c.where)
        for k in _CONSISTENT:
            if c.manifest.get(k) != first.manifest.get(k):
                raise InputError(f"manifest.{k}", f"differs from rank {min(files)}'s", c.where)
    weights = []
    for c in caps:
        w = {}
        for which in ("k1", "k2"):
            wp = _weights_path(c, which)
            w[which] = None if wp is None else load_weights(wp, verify_weights)
        weights.append(w)
    cs = CaptureSet(path, caps, weights)
    for r in range(world):
        _validate(cs, r)
    return cs


def _check_finite(args: dict, names, prefix: str) -> None:
    for n in names:
        t = args.get(n)
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise abi.ArgError(prefix + n, "contains NaN or Inf")


def _as_input_error(e: abi.ArgError, kernel: str, where: str) -> InputError:
    """Name the field as the capture does: k1.in.prefix, weights.k2.w13, ..."""
    f = e.field
    state, weights = (K1_STATE, K1_WEIGHTS) if kernel == "k1" else (K2_STATE, K2_WEIGHTS)
    if f in state:
        f = f"{kernel}.in.{f}"
    elif f in weights:
        f = f"weights.{kernel}.{f}"
    return InputError(f, str(e).split(": ", 1)[-1], where)


def _validate(cs: CaptureSet, rank: int) -> None:
    """Semantic checks of one rank: keys vs shapes vs config, indices, finiteness of inputs."""
    cap = cs.captures[rank]
    where = cap.where
    m = cap.manifest
    cfg = cs.cfg
    if cs.k2_key is not None and m["experts"] != cs.k2_key.experts:
        raise InputError("manifest.experts", f"{m['experts']!r} but k2_key.experts is {cs.k2_key.experts!r}", where)
    if cfg is not None and cfg.kind(cs.layer) != cs.kind:
        raise InputError("manifest.kind", f"{cs.kind} but config {cfg.name} makes layer {cs.layer} "
                                          f"{cfg.kind(cs.layer)}", where)
    if cfg is not None and cfg.world != cs.world:
        raise InputError("manifest.world", f"{cs.world} but config {cfg.name} is split for {cfg.world}", where)
    need = set() if cs.kind == "dense" else {"k2.in.core", "k2.in.prefix", "k2.in.blocks"}
    if cs.kind in K1_KINDS:
        need |= {f"k1.in.{n}" for n in K1_STATE if n != "delta"} | {"state.slot_map"}
        if cs.k1_key is None or m["state"] is None or m["weights"].get("k1") is None:
            raise InputError("manifest.k1_key", "a KDA capture needs k1_key, state and k1 weights", where)
    for n in sorted(need - set(cap.tensors)):
        raise InputError(n, "missing", where)
    for which, names in (("k1", K1_WEIGHTS), ("k2", K2_WEIGHTS)):
        if (which == "k1" and cs.kind not in K1_KINDS) or (which == "k2" and cs.kind == "dense"):
            continue
        w = cs._weights[rank][which]
        for n in names:
            if n not in w and n not in ("w13s", "w2s"):
                raise InputError(f"weights.{which}.{n}", "missing from the weight file", where)
    if cs.kind in K1_KINDS:
        _validate_k1(cs, rank, cfg, where)
    if cs.kind == "dense":
        return
    try:
        args = cs.k2_args(rank)
        d = abi.check_args(abi.K2_ARGS, args, "exact", cs.fmt, check_finite=False)
        _check_finite(args, K2_STATE, "k2.in.")
    except abi.ArgError as e:
        raise _as_input_error(e, "k2", where) from None
    key = cs.k2_key
    if key.tokens != d["S"]:
        raise InputError("k2_key.tokens", f"{key.tokens} but k2.in.prefix has {d['S']} rows", where)
    if not 0 <= key.nblocks <= d["NB"]:
        raise InputError("k2_key.nblocks", f"{key.nblocks} outside 0..{d['NB']}", where)
    if d["UP"] * cs.world != d["H"]:
        raise InputError("weights.k2.w_up", f"{d['UP']} rows × world {cs.world} != hidden {d['H']}", where)
    if cfg is not None:
        _dims_match(cfg, d, {"H": "hidden", "P": "p", "E": "experts", "LAT": "lat", "SI": "si", "UP": "up_n",
                             "NB": "nbmax"}, where)
        if d["RI2"] != 2 * cfg.ri:
            raise InputError("weights.k2.w13", f"{d['RI2']} rows, config {cfg.name} has 2·RI = {2 * cfg.ri}", where)
    for prefix, names in (("k2.after.", K2_AFTER), ("k1.after.", K1_AFTER)):
        for n in names:
            t = cap.tensors.get(prefix + n)
            ref_t = cap.tensors.get(("k1.in." if prefix == "k1.after." else "k2.in.") + n)
            if n == "out":
                ref_t = cap.tensors.get("k2.in.prefix")
            if n == "core_out":
                ref_t = cap.tensors.get("k2.in.core")
            if t is not None and ref_t is not None and (t.shape != ref_t.shape or t.dtype != ref_t.dtype):
                raise InputError(prefix + n, f"{dtype_name(t.dtype)} {list(t.shape)} does not match its input "
                                             f"{dtype_name(ref_t.dtype)} {list(ref_t.shape)}", where)


def _dims_match(cfg: Config, d: dict, pairs: dict, where: str) -> None:
    for sym, attr in pairs.items():
        if sym in d and d[sym] != getattr(cfg, attr):
            raise InputError(f"dims.{attr}", f"tensors give {sym}={d[sym]}, config {cfg.name} says "
                                             f"{getattr(cfg, attr)}", where)


def _validate_k1(cs: CaptureSet, rank: int, cfg: Config | None, where: str) -> None:
    cap = cs.captures[rank]
    st = cap.manifest["state"]
    key = cs.k1_key
    g = cap.group("k1.in.")
    smap = cap.tensors["state.slot_map"]
    for k in ("conv_slots", "rec_slots"):
        if not isinstance(st.get(k), int) or st[k] < 1:
            raise InputError(f"manifest.state.{k}", f"{st.get(k)!r} is not a positive slot count", where)
    if st.get("conv_layout") not in ("csl", "slc"):
        raise InputError("manifest.state.conv_layout", f"{st.get('conv_layout')!r}", where)
    sm = smap.tolist()
    if smap.dim() != 1 or not sm or sm[0] != 0 or len(set(sm)) != len(sm):
        raise InputError("state.slot_map", "must start with the null slot 0 and list distinct slots", where)
    if len(sm) != g["conv_state"].shape[0] or len(sm) != g["rstate"].shape[0]:
        raise InputError("state.slot_map", f"{len(sm)} slots but the caches carry {g['conv_state'].shape[0]} / "
                                           f"{g['rstate'].shape[0]}", where)
    if max(sm) >= st["rec_slots"] or min(sm) < 0:
        raise InputError("state.slot_map", f"slot {max(sm)} outside the recurrent cache ({st['rec_slots']} slots)",
                         where)
    L = key.qlen
    idx = g["st_idx"]
    if idx.dim() != 2 or idx.dtype != torch.int32:
        raise InputError("k1.in.st_idx", f"{dtype_name(idx.dtype)} {list(idx.shape)}, expected int32 [R, SW]", where)
    if idx.shape[1] < L:
        raise InputError("k1.in.st_idx", f"width {idx.shape[1]} < qlen {L}", where)
    na = g["num_acc"]
    if na.dim() != 1 or na.dtype != torch.int32 or na.shape[0] != idx.shape[0]:
        raise InputError("k1.in.num_acc", f"{dtype_name(na.dtype)} {list(na.shape)}, expected int32 "
                                          f"[{idx.shape[0]}]", where)
    for r, a in enumerate(na.tolist()):
        if not 1 <= a <= L:
            raise InputError("k1.in.num_acc", f"num_acc[{r}] = {a} outside 1..{L}", where)
    used = idx[:, :L]
    hi = int(used.max())
    if hi >= st["rec_slots"]:
        raise InputError("k1.in.st_idx", f"slot {hi} outside the recurrent cache ({st['rec_slots']} slots)", where)
    if int(idx[:, 0].max()) >= st["conv_slots"]:
        raise InputError("k1.in.st_idx", f"conv slot {int(idx[:, 0].max())} outside the conv cache "
                                         f"({st['conv_slots']} slots)", where)
    carried = set(sm)
    for v in sorted({int(v) for v in used.reshape(-1).tolist() if v > 0} - carried):
        raise InputError("k1.in.st_idx", f"slot {v} is referenced but not carried in state.slot_map", where)
    try:
        args = cs.k1_args(rank)
        d = abi.check_args(abi.K1_ARGS, args, "exact", check_finite=False)
        _check_finite(args, K1_STATE, "k1.in.")
        abi.check_k1_indices(args["st_idx"], args["num_acc"], L, d["CS"], d["RS"])
    except abi.ArgError as e:
        raise _as_input_error(e, "k1", where) from None
    S = d["S"]
    for cond, fld, msg in (
        (key.tokens != S, "k1_key.tokens", f"{key.tokens} but k1.in.prefix has {S} rows"),
        (L < 1 or S % L, "k1_key.qlen", f"{L} does not divide tokens={S}"),
        (d["R"] != S // max(L, 1), "k1.in.st_idx", f"{d['R']} requests, expected tokens/qlen = {S // max(L, 1)}"),
        (key.delta != ("delta" in g), "k1_key.delta", f"{key.delta} but delta is {'given' if 'delta' in g else 'absent'}"),
        (key.state_len != d["SL"], "k1_key.state_len", f"{key.state_len} but conv_state has {d['SL']}"),
        (d["SL"] < d["W"] - 2 + L, "k1.in.conv_state", f"state_len {d['SL']} < W-2+L = {d['W'] - 2 + L}"),
        (not 0 <= key.nblocks <= d["NB"], "k1_key.nblocks", f"{key.nblocks} outside 0..{d['NB']}"),
        (not -1 <= key.write_idx < d["NB"], "k1_key.write_idx", f"{key.write_idx} outside -1..{d['NB'] - 1}"),
        (d["P"] != d["NH"] * d["HD"] or d["C"] != 3 * d["P"], "weights.k1.w_fb", "P, C inconsistent with NH, HD"),
    ):
        if cond:
            raise InputError(fld, msg, where)
    if cfg is not None:
        _dims_match(cfg, d, {"H": "hidden", "NH": "nh", "HD": "hd", "RK": "rank", "W": "conv", "NP": "nproj",
                             "C": "qkv", "NB": "nbmax"}, where)
    if cs.k2_key is not None and cs.k2_key.tokens != S:
        raise InputError("k2_key.tokens", f"{cs.k2_key.tokens} but K1 has {S} tokens", where)


def load_sets(root, verify: bool = True) -> Iterable[CaptureSet]:
    for p in discover(root):
        yield load_set(p, verify)


__all__ = ["FORMAT", "SCHEMA", "POISON_BITS", "StepRecord", "Capture", "CaptureSet", "Untouched", "WeightHasher",
           "write_capture", "store_weights", "load_capture", "load_set", "load_sets", "load_weights", "discover",
           "capture_path", "set_dirname", "slot_map_for", "compact_cache", "remap_st_idx", "conv_layout_of",
           "tensor_sha256", "poison_", "same_bits", "producer", "versions", "git_revision"]
