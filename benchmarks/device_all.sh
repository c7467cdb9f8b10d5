#!/usr/bin/env bash
# Everything this project measures on the GPU node, in one call (device time is scarce):
# k3-tp8 capture set, reference timing, replays (ref, triton), fused benchmarks, GPU pinning.
#   bash benchmarks/device_all.sh [OUT_DIR]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${1:-${OUT:-/tmp/k3out}}; mkdir -p "$OUT"
K3="python -m harness.cli"
caps=/tmp/k3-tp8-caps
step() { echo "=== $*"; }
t() { local s=$(date +%s%N); "$@"; local rc=$?; echo "[rc=$rc, $(( ($(date +%s%N) - s) / 1000000 )) ms] $*"; return $rc; }
python -c "import torch, triton, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
step synth k3-tp8
[ -d $caps ] || t $K3 synth --config k3-tp8 --layers 1 --steps 1 --num-spec 3 --requests 1 --experts mxfp4 --device cuda --out $caps -q
step bench_ref
t python benchmarks/bench_ref.py --captures $caps --repeats 3 --json "$OUT/bench_ref.json"
step replay triton k3-tp8
t $K3 replay $caps --backend triton --device cuda --quiet --isolate --report "$OUT/replay_triton_k3.md" --json "$OUT/replay_triton_k3.json" | head -60
step bench_fast
t python benchmarks/bench_fast.py ${BENCH_FAST_ARGS:-} --json "$OUT/bench_fast.json" 2>&1 | tee "$OUT/bench_fast.txt" | tail -40
step replay ref k3-tp8
t $K3 replay $caps --backend ref --device cuda --quiet --report "$OUT/replay_ref_k3.md" --json "$OUT/replay_ref_k3.json" | head -3
step replay triton golden
t $K3 replay golden --backend triton --device cuda --quiet --report "$OUT/replay_triton_golden.md" | head -3
step pinning
t python benchmarks/check_pinning.py -n 1 | tail -3
