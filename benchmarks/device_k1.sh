#!/usr/bin/env bash
# K1 exploration in one device call (issue L):
#   VARIANTS="rec_pdl=1;k1_xc=1,k1_stages=5" TL="8x4,4x1" TLV="rec_pdl=1" bash benchmarks/device_k1.sh [OUT_DIR]
# 1. device_fast.sh with the shipped settings (GPU kernel tests with the planted bug, bench_fast
#    --no-tune: the table against the floor, golden replay, k3-tp8 --isolate replay; SKIP leaves
#    steps out), so a layout change is validated in the same call;
# 2. bench_k1 over VARIANTS (the defaults first) with the timeline of TL under TLV, in the time left
#    of BUDGET_S seconds (default 560).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${1:-${OUT:-/tmp/k3out}}; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
FAST_S=${FAST_S:-150} BENCH_FAST_ARGS=${BENCH_FAST_ARGS:---no-tune} bash benchmarks/device_fast.sh "$OUT" 2>&1 | grep -v Warning | tee "$OUT/device_fast.log"
left=$(( ${BUDGET_S:-560} - ($(date +%s) - t0) ))
echo "=== bench_k1 (${left}s left)"
timeout -k 5 "$left" python benchmarks/bench_k1.py --variants "${VARIANTS:-}" ${TL:+--timeline "$TL"} \
    ${TLV:+--tl-variants "$TLV"} ${CASES:+--cases "$CASES"} --json "$OUT/k1.json" 2>&1 | grep -v Warning | tee "$OUT/k1.log"
echo "[rc=${PIPESTATUS[0]}] bench_k1"
