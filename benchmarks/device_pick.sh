#!/usr/bin/env bash
# K1 variants, then the winner validated as the settings, in one device call (issue L):
#   VARIANTS="poll_nap=400;poll_nap=1500" [CASES=4x4,8x4] [K1_ARGS="--timeline 8x4 ..."] bash benchmarks/device_pick.sh [OUT_DIR]
# 1. bench_k1 over VARIANTS (the defaults first) at CASES; the variant with the smallest worst
#    K1/floor ratio wins if it beats the defaults by 0.01x (bench_k1 --best), else the defaults;
# 2. device_fast.sh with the winner as K3VERIFY_TRITON_TUNE: bench_fast --no-tune against the
#    floor, golden and k3-tp8 --isolate replays (SKIP leaves steps out), then the GPU kernel tests
#    (without the override: they set their knobs themselves).
# A winner ships by writing it into tuning.TUNE: the code then computes what was measured.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${1:-${OUT:-/tmp/k3out}}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
echo "=== bench_k1"
timeout -k 5 "${K1_S:-240}" python benchmarks/bench_k1.py --variants "${VARIANTS:-}" --cases "${CASES:-4x4,8x4}" \
    --json "$OUT/k1.json" --best "$OUT/best.txt" ${K1_ARGS:-} > "$OUT/k1.log" 2>&1
echo "[rc=$?] bench_k1"; grep -v Warning "$OUT/k1.log" | grep -v "^k1_rec" | tail -${K1_TAIL:-12}
win=$(tr -d '\n' < "$OUT/best.txt" 2>/dev/null)
echo "=== device_fast with K3VERIFY_TRITON_TUNE='$win'"
K3VERIFY_TRITON_TUNE="$win" SKIP="tests ${SKIP:-}" FAST_S=${FAST_S:-150} BENCH_FAST_ARGS=${BENCH_FAST_ARGS:---no-tune} \
    bash benchmarks/device_fast.sh "$OUT" 2>&1 | grep -v Warning | tee "$OUT/device_fast.log"
if [[ " ${SKIP:-} " != *" tests "* ]]; then
  env -u K3VERIFY_TRITON_TUNE SKIP="fast golden isolate" bash benchmarks/device_fast.sh "$OUT" 2>&1 | grep -v Warning
fi
