"""Where FlyDSL's tools come from, and how a compile-only build is run and measured.

FlyDSL lowers to AMDGPU code in-process; only the final link needs `ld.lld`, which
it looks up as `$ROCM_PATH/llvm/bin/ld.lld`. On a machine without ROCm we point
ROCM_PATH at a private shim folder whose `llvm/bin/ld.lld` links to a found linker
(Debian's `lld-19`: /usr/bin/ld.lld-19 or /usr/lib/llvm-19/bin/ld.lld).

Compile-only mode is FlyDSL's own (`COMPILE_ONLY=1 ARCH=gfx9xx`); the final ISA is
written with `FLYDSL_DEBUG_DUMP_ASM=1 FLYDSL_DUMP_DIR=...`, and its AMDGPU metadata
gives the resources (vgpr/sgpr/LDS = group segment/scratch = private segment).
"""
from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import shutil
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .occupancy import occupancy

ARCHS = ("gfx942", "gfx950")
_ENV_LOCK = threading.RLock()  # compile-only flips process env vars: one compile at a time


class ToolchainError(RuntimeError):
    pass


def flydsl_version() -> str | None:
    try:
        import flydsl
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return None
    return getattr(flydsl, "__version__", "unknown")


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "k3verify" / f"flydsl-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _candidates() -> list[str]:
    found = []
    for name in ("ld.lld", "ld.lld-19", "ld.lld-20", "ld.lld-18", "ld.lld-17"):
        p = shutil.which(name)
        if p:
            found.append(p)
    found += sorted(glob.glob("/usr/lib/llvm-*/bin/ld.lld"), reverse=True)
    return found


def _make_link(link: Path, target: str) -> None:
    if link.is_symlink() and os.path.realpath(link) == target:
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f"ld.lld.{os.getpid()}.{threading.get_ident()}")
    if tmp.exists() or tmp.is_symlink():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)  # atomic: parallel workers never see a half-made shim


def find_ld_lld() -> tuple[str | None, str]:
    """(ROCM_PATH to use, how it was found) or (None, why not)."""
    rp = os.environ.get("ROCM_PATH")
    if rp and os.access(os.path.join(rp, "llvm", "bin", "ld.lld"), os.X_OK):
        return rp, f"ROCM_PATH={rp}"
    if not rp and os.access("/opt/rocm/llvm/bin/ld.lld", os.X_OK):
        return "/opt/rocm", "/opt/rocm"
    cands = _candidates()
    if not cands:
        where = f"ROCM_PATH={rp} has no llvm/bin/ld.lld; " if rp else ""
        return None, (f"ld.lld not found ({where}no ld.lld / ld.lld-19 on PATH or under /usr/lib/llvm-*/bin; "
                      "install Debian's lld-19 or set ROCM_PATH to a ROCm install)")
    lld = os.path.realpath(cands[0])
    errors = []
    for root in (_cache_root(), Path(tempfile.gettempdir()) / f"k3verify-flydsl-{os.getuid()}"):
        shim = root / "rocm-shim"
        try:
            _make_link(shim / "llvm" / "bin" / "ld.lld", lld)
            break
        except OSError as e:
            errors.append(f"{shim}: {e}")
    else:
        return None, f"ld.lld found at {lld} but no shim folder could be made ({'; '.join(errors)})"
    return str(shim), f"shim {shim} -> {lld}"


def rocm_device() -> tuple[str | None, str]:
    """(arch of device 0, "") on a ROCm GPU, else (None, reason)."""
    try:
        import torch
    except Exception:  # noqa: BLE001
        return None, "no ROCm device (torch missing)"
    if getattr(torch.version, "hip", None) is None or not torch.cuda.is_available():
        return None, "no ROCm device"
    arch = torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName.split(":", 1)[0]
    if arch not in ARCHS:
        return None, f"no ROCm device of {'/'.join(ARCHS)} (found {arch})"
    return arch, ""


def available() -> tuple[bool, str]:
    if flydsl_version() is None:
        return False, "flydsl not installed"
    arch, why = rocm_device()
    if arch is None:
        return False, why
    rp, how = find_ld_lld()
    if rp is None:
        return False, how
    return True, ""


def compile_ready() -> tuple[bool, str]:
    """Can builds be compiled (without running) here?"""
    if flydsl_version() is None:
        return False, "flydsl not installed"
    rp, how = find_ld_lld()
    if rp is None:
        return False, how
    return True, how


@contextlib.contextmanager
def _env(updates: dict[str, str | None]):
    old = {k: os.environ.get(k) for k in updates}
    try:
        for k, v in updates.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _capture_fd2(path: Path):
    """Native LLVM diagnostics go to fd 2, not sys.stderr: catch them in a file."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


@contextlib.contextmanager
def flydsl_env(arch: str | None, compile_only: bool, dump_dir: str | None = None):
    """Process env for one FlyDSL compile: linker, target, compile-only, ISA dump.

    The on-disk kernel cache is off: it stores pickles (never loaded here), and a
    compile-only run must measure real compile times.
    """
    rp, how = find_ld_lld()
    if rp is None:
        raise ToolchainError(how)
    upd: dict[str, str | None] = {"ROCM_PATH": rp, "FLYDSL_RUNTIME_ENABLE_CACHE": "0"}
    if compile_only:
        upd.update(COMPILE_ONLY="1", ARCH=arch, FLYDSL_GPU_ARCH=arch)
    if dump_dir:
        upd.update(FLYDSL_DEBUG_DUMP_ASM="1", FLYDSL_DUMP_DIR=dump_dir)
    with _ENV_LOCK, _env(upd):
        yield


def runtime_env() -> None:
    """Process env for executing on a ROCm device: a linker for the first compile, and
    no on-disk kernel cache (it is pickles) unless the user chose otherwise."""
    if os.environ.get("COMPILE_ONLY", "").lower() in ("1", "true", "yes", "on"):
        raise ToolchainError("COMPILE_ONLY is set in the environment: FlyDSL would compile and not run")
    rp, how = find_ld_lld()
    if rp is None:
        raise ToolchainError(how)
    os.environ["ROCM_PATH"] = rp
    os.environ.setdefault("FLYDSL_RUNTIME_ENABLE_CACHE", "0")


# ---------------------------------------------------------------- ISA resources

@dataclass
class Resources:
    vgpr: int
    agpr: int
    sgpr: int
    lds: int  # group segment bytes
    scratch: int  # private segment bytes (per lane)
    vgpr_spill: int
    sgpr_spill: int
    code_bytes: int | None
    wavefront: int
    wg_size: int  # threads per workgroup (max flat workgroup size)
    waves: int = 0  # occupancy: waves per SIMD (occupancy.py)
    waves_limit: str = ""  # what bounds it: vgpr | sgpr | lds | wg
    seconds: float = 0.0  # wall time of the compile (with the ISA dump)


_META_KEYS = {
    "vgpr": r"\.vgpr_count:\s+(\d+)",
    "agpr": r"\.agpr_count:\s+(\d+)",
    "sgpr": r"\.sgpr_count:\s+(\d+)",
    "lds": r"\.group_segment_fixed_size:\s+(\d+)",
    "scratch": r"\.private_segment_fixed_size:\s+(\d+)",
    "vgpr_spill": r"\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spill": r"\.sgpr_spill_count:\s+(\d+)",
    "wavefront": r"\.wavefront_size:\s+(\d+)",
    "wg_size": r"\.max_flat_workgroup_size:\s+(\d+)",
}


def parse_isa(text: str, kernel: str) -> dict[str, int]:
    """Resources of `kernel` from the `.amdgpu_metadata` YAML block of an ISA dump."""
    m = re.search(r"\.amdgpu_metadata(.*?)\.end_amdgpu_metadata", text, re.S)
    if not m:
        raise ToolchainError(f"ISA dump of {kernel} has no .amdgpu_metadata block")
    meta = m.group(1)
    blocks = re.split(r"\n  - \.", meta)  # one entry per kernel (args are nested deeper)
    block = next((b for b in blocks if re.search(rf"\.name:\s+{re.escape(kernel)}\s*\n", "." + b)), None)
    if block is None:
        raise ToolchainError(f"ISA dump has no metadata for kernel {kernel}")
    block = "." + block
    out = {}
    for k, pat in _META_KEYS.items():
        mm = re.search(pat, block)
        if mm is None:
            raise ToolchainError(f"ISA metadata of {kernel} lacks {pat.split(':')[0]}")
        out[k] = int(mm.group(1))
    return out


def _unescape_mlir(s: str) -> bytes:
    out = bytearray()
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c == "\\" and i + 2 < n + 1 and re.match(r"[0-9A-Fa-f]{2}", s[i + 1:i + 3] or ""):
            out.append(int(s[i + 1:i + 3], 16))
            i += 3
        elif c == "\\" and i + 1 < n:
            out.append(ord(s[i + 1]))
            i += 2
        else:
            out += c.encode("latin-1")
            i += 1
    return bytes(out)


def elf_symbol_size(elf: bytes, name: str) -> int | None:
    """st_size of a function symbol in an ELF64 little-endian object (AMDGPU code object)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        return None
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    for sec in secs:
        if sec[1] != 2:  # SHT_SYMTAB
            continue
        strtab = secs[sec[6]]
        off, size, entsize = sec[4], sec[5], sec[9] or 24
        for j in range(size // entsize):
            st_name, st_info, _o, _sh, _v, st_size = struct.unpack_from("<IBBHQQ", elf, off + j * entsize)
            s0 = strtab[4] + st_name
            nm = elf[s0:elf.index(b"\0", s0)].decode()
            if nm == name and (st_info & 0xF) == 2:  # STT_FUNC
                return st_size
    return None


def _artifact_text(jit_fn) -> str | None:
    last = getattr(jit_fn, "_last_compiled", None)
    return getattr(last[1], "_ir_text", None) if last else None


def code_bytes_of(jit_fn, kernel: str) -> int | None:
    """Machine-code size of `kernel` from the code object FlyDSL just built (None if unknown)."""
    text = _artifact_text(jit_fn)
    m = re.search(r'bin = "((?:[^"\\]|\\.)*)"', text or "")
    if not m:
        return None
    return elf_symbol_size(_unescape_mlir(m.group(1)), kernel)


_BIN_KEYS = {"vgpr": "vgpr_count", "agpr": "agpr_count", "sgpr": "sgpr_count", "lds": "group_segment_fixed_size",
             "scratch": "private_segment_fixed_size"}


def binary_metadata(jit_fn, kernel: str) -> dict[str, int] | None:
    """The same resources as the code object's kernel metadata records them (a second,
    independent read: the ISA dump is a separate codegen run)."""
    text = _artifact_text(jit_fn) or ""
    i = text.find(f'#gpu.kernel_metadata<"{kernel}"')
    if i < 0:
        return None
    j = text.find("metadata = {", i)
    block = text[j:text.find("}", j)]
    out = {}
    for k, name in _BIN_KEYS.items():
        m = re.search(rf"\b{name} = (\d+)", block)
        if m:
            out[k] = int(m.group(1))
    return out


_MEASURED: dict = {}


def _sig(t):
    st = t.stride()
    return (t.dtype, t.dim(), st.index(1) if 1 in st else -1)


def compile_measure(jit_fn, args: tuple, kernel: str, arch: str, keep_dir: str | None = None) -> Resources:
    """Compile `jit_fn(*args)` for `arch` without running it; read its ISA resources.

    FlyDSL keeps compiled artifacts in memory and does not dump the ISA of a cache hit,
    so a specialization measured once in this process is answered from that first
    measurement (`seconds` then being the first compile's)."""
    key = (kernel, arch, tuple(_sig(a) for a in args), keep_dir)
    if key not in _MEASURED:
        _MEASURED[key] = _compile_measure(jit_fn, args, kernel, arch, keep_dir)
    return _MEASURED[key]


def _compile_measure(jit_fn, args, kernel, arch, keep_dir) -> Resources:
    import flydsl.compiler as flyc

    tmp = tempfile.mkdtemp(prefix="k3fly-")
    try:
        dump = keep_dir or os.path.join(tmp, "isa")
        log = Path(tmp) / "stderr.txt"
        t0 = time.perf_counter()
        with flydsl_env(arch, True, dump), _capture_fd2(log), contextlib.redirect_stdout(io.StringIO()):
            try:
                flyc.compile(jit_fn, *args)
            except Exception as e:
                raise ToolchainError(f"{kernel} [{arch}]: {type(e).__name__}: {str(e).splitlines()[0]}") from e
        errs = [ln for ln in log.read_text(errors="replace").splitlines() if "error" in ln.lower()]
        if errs:
            # LLVM reports some failures (e.g. a missing libcall) without failing the build
            raise ToolchainError(f"{kernel} [{arch}]: LLVM reported: {errs[0]}")
        isa = sorted(glob.glob(os.path.join(dump, kernel, "*_final_isa.s")))
        if not isa:
            raise ToolchainError(f"{kernel} [{arch}]: no final ISA dumped under {dump}")
        text = Path(isa[-1]).read_text()
        if f'-{arch}"' not in text:
            raise ToolchainError(f"{kernel}: ISA was not built for {arch}")
        r = parse_isa(text, kernel)
        meta = binary_metadata(jit_fn, kernel)
        if meta:
            diff = {k: (r[k], v) for k, v in meta.items() if r[k] != v}
            if diff:
                raise ToolchainError(f"{kernel} [{arch}]: ISA dump and code object disagree (isa, bin): {diff}")
        waves, limit = occupancy(arch, r["vgpr"], r["sgpr"], r["lds"], r["wg_size"])
        return Resources(code_bytes=code_bytes_of(jit_fn, kernel), waves=waves, waves_limit=limit,
                         seconds=time.perf_counter() - t0, **r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
