"""The capture file format (docs/capture-format.md): constants, dtypes, poison, hashing, and
the strict reading of a safetensors header — the first thing done with any file, before a
byte of tensor data is touched.

`read_header(path)` refuses, with one InputError naming the file and the field: a path that
is not a regular file (a FIFO or device never blocks an open), a truncated file, a header
that is not a flat JSON object (deep nesting included), a tensor entry whose `dtype` is
unknown, whose `shape` is not a list of non-negative ints, or whose `data_offsets` are not
two ints inside the data, sized for the shape and not overlapping another tensor's.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ref import abi

from ..errors import InputError

FORMAT = "k3verify-capture"
WEIGHTS_FORMAT = "k3verify-weights"
SCHEMA = 2  # what the writer writes
READS = (1, 2)  # what the loader reads
META_KEY = "k3verify"
WEIGHT_LAYOUT = "logical"  # DESIGN §7 logical layouts, no backend pre-shuffle
MAX_HEADER = 100 << 20  # bytes of safetensors header JSON a loader accepts

K1_STATE = ("prefix", "delta", "blocks", "conv_state", "rstate", "st_idx", "num_acc")
K1_WEIGHTS = abi.K1_WEIGHTS
K1_AFTER = ("prefix", "blocks", "conv_state", "rstate", "core_out")
K2_STATE = ("core", "prefix", "blocks")
K2_WEIGHTS = abi.K2_WEIGHTS
K2_AFTER = ("prefix", "out", "blocks")
DENSE_AFTER = ("prefix", "out")
KINDS = ("kda", "mla", "dense")
K1_KINDS = ("kda", "dense")  # layers with a K1 launch (a dense layer has no K2)

# tensor-name groups of a capture, by layer kind
GROUPS = {"k1.in.": K1_STATE, "k1.after.": K1_AFTER, "k2.in.": K2_STATE, "k2.after.": K2_AFTER,
          "dense.after.": DENSE_AFTER}
KIND_GROUPS = {"kda": ("k1.in.", "k1.after.", "k2.in.", "k2.after."), "mla": ("k2.in.", "k2.after."),
               "dense": ("k1.in.", "k1.after.", "dense.after.")}
SLOT_MAP = "state.slot_map"

# NaN payloads: bit patterns a kernel never produces by arithmetic.
POISON_BITS = {torch.bfloat16: (torch.int16, 0x7FA5), torch.float32: (torch.int32, 0x7FA5A5A5),
               torch.float64: (torch.int64, 0x7FF5A5A5A5A5A5A5), torch.float16: (torch.int16, 0x7E5A)}

POISON_FINITE = -4242.0  # far from any real activation or state value; bf16 rounds it to -4256

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool)}
ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "uint8": "U8", "int8": "I8",
             "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL"}
ST_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
FROM_ST = {v: k for k, v in ST_DTYPES.items()}


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def st_dtype(name: str) -> str:
    return ST_DTYPES.get(name, name)


def nbytes(dtype: str, shape) -> int:
    return math.prod(shape) * DTYPES[dtype].itemsize


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


def canon(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def loads(raw, field: str, where: str):
    """json.loads that turns every failure (bad UTF-8 or JSON, nesting too deep) into InputError."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise InputError(field, "JSON nested too deeply", where) from None
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError(field, f"not valid JSON ({e})", where) from None


# --------------------------------------------------------------------------- regular files only

def open_regular(path: Path, field: str = "file"):
    """Open a regular file for reading. A FIFO, device or socket is refused without blocking:
    the open is non-blocking and the kind is read from the open descriptor."""
    where = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError(field, "not found", where) from None
    except IsADirectoryError:
        raise InputError(field, "is a directory", where) from None
    except OSError as e:
        raise InputError(field, f"cannot open ({e.strerror})", where) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
            "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file"
        raise InputError(field, f"is {kind}, not a regular file", where)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def regular_stat(path: Path, field: str = "file") -> os.stat_result:
    """stat of a regular file (the same refusals as open_regular, without opening)."""
    with open_regular(path, field) as f:
        return os.fstat(f.fileno())


# --------------------------------------------------------------------------- strict header

@dataclass
class Header:
    """A validated safetensors header: tensor entries (dtype code, shape, [begin, end) of the
    data), the string metadata, the data's start offset and the file's size and mtime."""

    path: Path
    tensors: dict  # name -> {"dtype": "BF16", "shape": [..], "data_offsets": [b, e]}
    metadata: dict
    data_start: int
    size: int
    mtime_ns: int

    @property
    def where(self) -> str:
        return str(self.path)

    def manifest(self) -> dict:
        """The k3verify JSON manifest of the metadata (InputError if absent or not an object)."""
        if META_KEY not in self.metadata:
            raise InputError("manifest", f"no {META_KEY!r} manifest in the safetensors metadata", self.where)
        man = loads(self.metadata[META_KEY], "manifest", self.where)
        if not isinstance(man, dict):
            raise InputError("manifest", "not a JSON object", self.where)
        return man


def _nonneg_ints(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def read_header(path: str | os.PathLike) -> Header:
    """The strict header of a safetensors file (see the module docstring)."""
    path = Path(path)
    where = str(path)
    with open_regular(path) as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        head = f.read(8)
        if len(head) < 8:
            raise InputError("file", f"truncated: {size} bytes, no safetensors header", where)
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > MAX_HEADER:
            raise InputError("file", f"truncated or corrupt: header of {n} bytes in a {size}-byte file", where)
        raw = f.read(n)
    if len(raw) != n:
        raise InputError("file", f"truncated: header of {n} bytes, read {len(raw)}", where)
    try:
        header = loads(raw, "file", where)
    except InputError as e:
        raise InputError("file", f"corrupt safetensors header: {e.msg}", where) from None
    if not isinstance(header, dict):
        raise InputError("file", "corrupt safetensors header (not an object)", where)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InputError("header.__metadata__", "not a map of strings to strings", where)
    data = size - 8 - n
    spans = []
    for name, e in header.items():
        fld = f"header.{name}"
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise InputError(fld, "needs exactly dtype, shape and data_offsets", where)
        if e["dtype"] not in ST_ITEMSIZE:
            raise InputError(f"{fld}.dtype", f"unknown dtype {e['dtype']!r}", where)
        if not _nonneg_ints(e["shape"]):
            raise InputError(f"{fld}.shape", f"{e['shape']!r} is not a list of non-negative ints", where)
        off = e["data_offsets"]
        if not _nonneg_ints(off) or len(off) != 2 or off[0] > off[1]:
            raise InputError(f"{fld}.data_offsets", f"{off!r} is not [begin, end] with 0 <= begin <= end", where)
        want = math.prod(e["shape"]) * ST_ITEMSIZE[e["dtype"]]
        if off[1] - off[0] != want:
            raise InputError(f"{fld}.data_offsets", f"{off[1] - off[0]} bytes for {e['dtype']} {e['shape']} "
                                                    f"({want} bytes)", where)
        spans.append((off[0], off[1], name))
    end = max((e for _, e, _ in spans), default=0)
    if end > data:
        name = max(spans)[2] if spans else ""
        raise InputError("file", f"truncated or corrupt: tensor {name!r} ends at data byte {end}, the file "
                                 f"holds {data}", where)
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0 and b1 < e1:
            raise InputError(f"header.{n1}.data_offsets", f"overlaps tensor {n0!r}", where)
    return Header(path, header, meta, 8 + n, size, st.st_mtime_ns)


# --------------------------------------------------------------------------- memory-mapped reading

@functools.lru_cache(maxsize=64)
def _open(path: str, mtime_ns: int, size: int):
    from safetensors import safe_open

    return safe_open(path, framework="pt", device="cpu")


def handle(hdr: Header):
    """The (cached) safetensors handle of a file whose header was read strictly."""
    try:
        return _open(str(hdr.path), hdr.mtime_ns, hdr.size)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise InputError("file", f"unreadable safetensors file ({e})", hdr.where) from None


__all__ = ["FORMAT", "WEIGHTS_FORMAT", "SCHEMA", "READS", "META_KEY", "WEIGHT_LAYOUT", "K1_STATE", "K1_WEIGHTS",
           "K1_AFTER", "K2_STATE", "K2_WEIGHTS", "K2_AFTER", "DENSE_AFTER", "KINDS", "K1_KINDS", "GROUPS",
           "POISON_BITS", "POISON_FINITE", "DTYPES", "Header", "dtype_name", "tensor_sha256", "poison_", "same_bits",
           "canon", "loads", "open_regular", "regular_stat", "read_header", "handle", "nbytes", "st_dtype"]
