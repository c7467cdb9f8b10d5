#!/usr/bin/env bash
# Set up .venv at the repository root (idempotent, quiet). On a machine without a GPU
# it takes the CPU build of torch; on a GPU node set K3_TORCH to the torch you want
# (e.g. K3_TORCH=torch, or K3_TORCH=skip to keep what the venv already has).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
stamp=.venv/.k3verify-installed
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "k3verify: setting up .venv (first run takes a minute)..." >&2
if ! "$VPY" -c "import torch" 2>/dev/null; then
  case "${K3_TORCH:-torch==2.13.0}" in
    skip) ;;
    *) "$VPY" -m pip install -q --disable-pip-version-check "${K3_TORCH:-torch==2.13.0}" ;;
  esac
fi
"$VPY" -m pip install -q --disable-pip-version-check -e '.[dev,rocm]'
# The CPU build of torch brings no Triton; the interpreter tier needs Triton >= 3.9. A GPU
# build of torch pins its own Triton, which is kept.
if ! "$VPY" -c "import torch, sys; sys.exit(0 if (torch.version.cuda or torch.version.hip) else 1)"; then
  "$VPY" -m pip install -q --disable-pip-version-check 'triton>=3.9'
fi
echo "$want" > "$stamp"
