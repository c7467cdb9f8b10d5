"""Triton backend: fused K1/K2 of the DESIGN §6 contract for CUDA, ROCm and the CPU
interpreter (TRITON_INTERPRET=1, read when the kernels are first imported).

K1: 2 launches; K2: 5 launches and the 3 reductions through the collective. `health()` reports
what the kernels flagged (a ticket wait that timed out, a handshake left open).
docs/triton.md describes every kernel.
"""
from __future__ import annotations

import os

from ref.abi import K1_TAPS, K2_TAPS


class _Backend:
    name = "triton"
    TAPS_K1 = K1_TAPS
    TAPS_K2 = K2_TAPS

    @property
    def version(self) -> str:
        """The backend's version; a K3VERIFY_TRITON_TUNE override is part of it (reports show it)."""
        try:
            import triton
            v = f"0.1.0+triton{triton.__version__}"
        except ImportError:
            v = "0.1.0"
        from .tuning import ENV
        tune = os.environ.get(ENV, "").strip()
        return f"{v} ({ENV}={tune})" if tune else v

    def available(self) -> tuple[bool, str]:
        try:
            import triton  # noqa: F401
        except ImportError:
            return False, "triton not installed"
        from .tuning import env_overrides
        try:
            env_overrides()
        except ValueError as e:
            return False, str(e)
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            return True, "CPU interpreter (TRITON_INTERPRET=1)"
        import torch
        if torch.cuda.is_available():
            return True, torch.cuda.get_device_name()
        return False, "no CUDA/ROCm device (set TRITON_INTERPRET=1 to run interpreted on the CPU)"

    def kda_pre(self, key, **kw):
        from ._host import kda_pre
        return kda_pre(key, **kw)

    def k2_launch(self, key, **kw):
        from ._host import k2_launch
        return k2_launch(key, **kw)

    def health(self) -> list[str]:
        """Problems seen since the last call, one line each ([] = healthy); synchronizes the
        device and clears what it read. Call once per step, after K1 and K2."""
        from ._host import health
        return health()


BACKEND = _Backend()
__all__ = ["BACKEND"]
