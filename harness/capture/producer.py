"""Who wrote a capture: the manifest's producer block (tool, versions, device, git revision).

`git_revision` never writes into the repository it reads: `git describe --dirty` and a
plain `git status` refresh the index and take `.git/index.lock`; here the commit comes from
`git rev-parse` and the dirty bit from `git status` with GIT_OPTIONAL_LOCKS=0 (no refresh
written back), both read-only.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent.parent


def _git(args, cwd) -> str | None:
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", LC_ALL="C")
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, env=env,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def git_revision(cwd: str | os.PathLike | None = None) -> str | None:
    """The checkout's commit (12 hex digits, "-dirty" with uncommitted changes to tracked
    files); None outside git. Read-only: takes no lock, writes nothing."""
    cwd = cwd or ROOT
    rev = _git(["rev-parse", "--short=12", "HEAD"], cwd)
    if not rev or not rev.strip():
        return None
    st = _git(["status", "--porcelain", "--untracked-files=no", "--ignore-submodules"], cwd)
    return rev.strip() + ("-dirty" if st and st.strip() else "")


def _pyproject_version() -> str | None:
    try:
        m = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


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


def device_name(device) -> str:
    d = torch.device(device)
    if d.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(d)}"
    return d.type


def producer(tool: str, device="cpu", git: bool = True, **extra) -> dict:
    """The manifest's producer block. No timestamps: the same run writes the same bytes."""
    return {"tool": tool, "versions": versions(), "device": device_name(device),
            "git": git_revision() if git else None, **extra}


__all__ = ["git_revision", "versions", "device_name", "producer"]
