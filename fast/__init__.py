"""Backend registry. A backend is any object (or module) with `kda_pre(key, **abi)`
and `k2_launch(key, **abi)` of the DESIGN §6 contract; optionally `available()`
-> (ok, reason), `name`, `version`, `TAPS_K1` / `TAPS_K2` (the taps it can fill when
called with `taps={}`), `health()` -> list of problems since the last call (read by the
engine after every step; any problem fails the capture), and `compile_build(key)` (build a
kernel before a step runs it).
"""
from __future__ import annotations

import importlib

BUILTIN = {
    "ref": "fast.ref_backend:BACKEND",
    "triton": "fast.triton:BACKEND",
    "flydsl": "fast.flydsl:BACKEND",
    "vllm-mono": "fast.vllm_mono:BACKEND",
}


class BackendError(ValueError):
    pass


def load_backend(spec: str):
    """'ref' | 'triton' | 'flydsl' | 'package.module:object' -> backend object."""
    target = BUILTIN.get(spec, spec)
    if ":" not in target:
        raise BackendError(f"backend: {spec!r} is neither {', '.join(BUILTIN)} nor package.module:object")
    mod_name, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise BackendError(f"backend: cannot import {mod_name!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a backend module that raises on import is bad input, not a crash
        raise BackendError(f"backend: importing {mod_name!r} raised {type(e).__name__}: {e}") from None
    try:
        obj = getattr(mod, attr)
    except AttributeError:
        raise BackendError(f"backend: {mod_name!r} has no attribute {attr!r}") from None
    for fn in ("kda_pre", "k2_launch"):
        if not callable(getattr(obj, fn, None)):
            raise BackendError(f"backend: {spec!r} has no callable {fn}")
    return obj


def available(backend) -> tuple[bool, str]:
    fn = getattr(backend, "available", None)
    if fn is None:
        return True, ""
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001 - a failing probe means: not available, and why
        return False, f"available() raised {type(e).__name__}: {e}"
    if isinstance(res, tuple):
        return bool(res[0]), str(res[1] if len(res) > 1 else "")
    return bool(res), ""


def backend_name(backend, spec: str = "") -> str:
    return getattr(backend, "name", None) or spec or type(backend).__name__
