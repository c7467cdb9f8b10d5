#!/usr/bin/env bash
# The fused kernels (issue L) in one device call:
#   bash benchmarks/device_fast.sh [OUT_DIR]
# 1. the GPU-only kernel tests (the PTX nibble decode; programmatic dependent launch changes no bit),
#    then the nibble tests on a copy with a planted decode bug (they must fail);
# 2. bench_fast (tuning pass, the table against the memory floor; BENCH_FAST_ARGS adds arguments);
# 3. the golden set and a k3-tp8 capture set (--isolate: both views) through Triton on the GPU.
# SKIP="tests fast golden isolate" leaves steps out; each step has its own time limit.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${1:-${OUT:-/tmp/k3out}}; mkdir -p "$OUT"
K3="python -m harness.cli"
t() { local lim=$1; shift; local s=$(date +%s%N); timeout -k 5 "$lim" "$@"; local rc=$?
      echo "[rc=$rc, $(( ($(date +%s%N) - s) / 1000000 )) ms] $*"; return $rc; }
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }
python -c "import torch, triton, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if ! skip tests; then
echo "=== GPU kernel tests"
t 180 python -m pytest -q -p no:cacheprovider tests/test_triton_nibble.py tests/test_triton_pdl.py 2>&1 | tail -3
echo "=== the same with a planted bug (byte permute of the second fp16 pair): must fail"
rm -rf /tmp/plant && mkdir /tmp/plant && cp -r fast ref harness tests pyproject.toml /tmp/plant/
sed -i 's/0x3424;/0x2434;/' /tmp/plant/fast/triton/_jit.py
(cd /tmp/plant && PYTHONPATH=/tmp/plant t 120 python -m pytest -q -p no:cacheprovider tests/test_triton_nibble.py -k ptx 2>&1 | tail -2)
fi
if ! skip fast; then
echo "=== bench_fast"
t ${FAST_S:-260} python benchmarks/bench_fast.py ${BENCH_FAST_ARGS:-} --json "$OUT/bench_fast.json" > "$OUT/bench_fast.txt" 2>&1
tail -60 "$OUT/bench_fast.txt"
fi
if ! skip golden; then
echo "=== replay golden triton"
t ${GOLDEN_S:-120} $K3 replay golden --backend triton --device cuda --quiet --report "$OUT/replay_triton_golden.md" | head -3
fi
if ! skip isolate; then
echo "=== replay k3-tp8 --isolate triton"
caps=/tmp/k3-tp8-caps
[ -d $caps ] || t 90 $K3 synth --config k3-tp8 --layers 1 --steps 1 --num-spec 3 --requests 1 --experts mxfp4 --device cuda --out $caps -q
t ${ISOLATE_S:-150} $K3 replay $caps --backend triton --device cuda --quiet --isolate --report "$OUT/replay_triton_k3.md" | head -5
fi
