#!/usr/bin/env bash
# Corpus scale at k3-tp8 (issue I) and the k3-tp8 policy derivation (issue H), one device call:
#   bash benchmarks/device_corpus.sh [OUT_DIR]
# 1. make a 2-layer x 8-step k3-tp8 corpus (timed, disk bytes);
# 2. derive the k3-tp8 chained and isolated limits on 4 other steps (seed 1), kept as a measurement
#    ($OUT/k3-tp8-h200.json -> golden/derived/ after review), and install them in this copy's policy
#    beside the shipped golden measurement (DERIVE_INCLUDE: `policy derive golden --seeds 8 --save`);
# 3. replay the corpus set by set through Triton, both views (load/run/judge s, peak memory per set);
# 3b. the same again in a second process (Triton's kernel cache warm: the first set without the JIT);
# 4. the same corpus through `k3verify replay` (the product's verdict and report);
# 5. the golden set through Triton on the GPU;
# 6. bench_fast (the fused kernels against the memory floor, issue L).
# Every step has its own time limit (*_S), so one that hangs leaves the others' results in OUT;
# SKIP="derive warm cli fast" leaves steps out (derive: replay with the shipped k3-tp8 limits).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${1:-${OUT:-/tmp/k3out}}; mkdir -p "$OUT"
CORPUS=/tmp/k3-corpus
K3="python -m harness.cli"
INC=${DERIVE_INCLUDE:-.devcarry/golden-cpu.json}
t() { local lim=$1; shift; local s=$(date +%s%N); timeout -k 5 "$lim" "$@"; local rc=$?
      echo "[rc=$rc, $(( ($(date +%s%N) - s) / 1000000 )) ms] $*"; return $rc; }
python -c "import torch, triton, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
echo "=== synth"
t 150 python benchmarks/bench_replay.py --config k3-tp8 --layers 1-2 --steps 8 --synth-only --out $CORPUS --json /tmp/synth.json > /tmp/synth.log 2>&1; tail -1 /tmp/synth.log
du -sb $CORPUS
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }
if ! skip derive; then
echo "=== policy derive k3-tp8"
t 90 $K3 synth --config k3-tp8 --layers 1-2 --steps ${DERIVE_STEPS:-4} --num-spec 3 --requests 1 --experts mxfp4 \
  --seed 1 --device cuda --out /tmp/k3-derive -q
inc=(); [ -f "$INC" ] && inc=(--include "$INC")
t ${DERIVE_S:-200} $K3 policy derive /tmp/k3-derive --seeds ${DERIVE_SEEDS:-4} --device cuda --quiet "${inc[@]}" \
  --save "$OUT/k3-tp8-h200.json" --update golden/tolerances.toml > /tmp/derive.log 2>&1; tail -2 /tmp/derive.log
fi
echo "=== bench_replay corpus"
t ${REPLAY_S:-240} python benchmarks/bench_replay.py --captures $CORPUS --backend triton --profile ${PROFILE_SET:-9} --json "$OUT/bench_replay.json" 2>&1 \
  | grep --line-buffered -v "it/s\]" | tee "$OUT/bench_replay.txt" | grep -v "^ \|^$\|---\|Ordered\|List red\|function calls" | tail -24
if ! skip warm; then  # a second process: the Triton kernels load from the disk cache the first one filled
echo "=== bench_replay corpus, kernel cache warm"
t ${REPLAY_S:-240} python benchmarks/bench_replay.py --captures $CORPUS --backend triton --json "$OUT/bench_replay_warm.json" 2>&1 \
  | grep --line-buffered -v "it/s\]" | tee "$OUT/bench_replay_warm.txt" | grep "^set   1\|^set   9\|^|" | tail -5
fi
skip cli || echo "=== k3verify replay corpus"
skip cli || t ${CLI_S:-150} $K3 replay $CORPUS --backend triton --device cuda --quiet --report "$OUT/replay_corpus.md" | head -3
echo "=== replay golden triton"
t ${GOLDEN_S:-120} $K3 replay golden --backend triton --device cuda --quiet --report "$OUT/replay_triton_golden.md" | head -3
skip fast && exit 0
echo "=== bench_fast"
t ${FAST_S:-200} python benchmarks/bench_fast.py --json "$OUT/bench_fast.json" > "$OUT/bench_fast.txt" 2>&1; tail -40 "$OUT/bench_fast.txt"
