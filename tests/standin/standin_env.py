"""Put the stand-in vLLM on sys.path for a test, and take it (and the plugin's wrappers) away after."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

STANDIN = str(Path(__file__).resolve().parent)
_OURS = ("vllm", "k3_runtime", "standin_env")


def _drop_modules() -> None:
    for m in [m for m in sys.modules if m.split(".")[0] in _OURS[:2]]:
        del sys.modules[m]


@contextmanager
def standin(env: dict | None = None):
    """The stand-in importable as `vllm` (and `k3_runtime`), `env` set; afterwards the plugin is
    deactivated, the modules forgotten, the environment and sys.path restored."""
    from harness import vllm_plugin

    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    sys.path.insert(0, STANDIN)
    _drop_modules()
    try:
        yield
    finally:
        vllm_plugin.deactivate()
        _drop_modules()
        sys.path.remove(STANDIN)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
