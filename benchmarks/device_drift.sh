#!/usr/bin/env bash
# Closed-loop drift at the real shape (issue K), one device call:
#   bash benchmarks/device_drift.sh [OUT_DIR] [STEPS] [LAYERS]
# Triton as the backend, k3-tp8, world 8 simulated on one GPU; reports under OUT_DIR.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${1:-${OUT:-/tmp/k3out}}; mkdir -p "$OUT"
STEPS=${2:-64}; LAYERS=${3:-1-2}
python -c "import torch, triton, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
s=$(date +%s)
python -m harness.cli drift --config k3-tp8 --layers "$LAYERS" --steps "$STEPS" --num-spec 3 --backend triton \
  --device cuda --report "$OUT/drift_k3.md" --json "$OUT/drift_k3.json" --html "$OUT/drift_k3.html" 2>&1 | tail -5
echo "[rc=${PIPESTATUS[0]}, $(( $(date +%s) - s )) s] drift k3-tp8 layers $LAYERS steps $STEPS"
head -12 "$OUT/drift_k3.md"
