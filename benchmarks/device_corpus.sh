#!/usr/bin/env bash
# Corpus scale at k3-tp8 (issue I) and the k3-tp8 policy derivation (issue H), one device call:
#   bash benchmarks/device_corpus.sh [OUT_DIR]
# 1. make a 2-layer x 8-step k3-tp8 corpus (timed, disk bytes);
# 2. derive the k3-tp8 chained and isolated limits on 2 other steps (seed 1) (kept as a measurement:
#    golden/derived/k3-tp8-h200.json after review) and install them in this copy's policy;
# 3. replay the corpus set by set through Triton, both views (load/run/judge s, peak memory per set);
# 4. the golden set through Triton on the GPU.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${1:-${OUT:-/tmp/k3out}}; mkdir -p "$OUT"
CORPUS=/tmp/k3-corpus
t() { local s=$(date +%s%N); "$@"; local rc=$?; echo "[rc=$rc, $(( ($(date +%s%N) - s) / 1000000 )) ms] $*"; return $rc; }
python -c "import torch, triton, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
echo "=== synth"
t python benchmarks/bench_replay.py --config k3-tp8 --layers 1-2 --steps 8 --synth-only --out $CORPUS --json "$OUT/synth.json" > "$OUT/synth.log" 2>&1; tail -3 "$OUT/synth.log"
du -sb $CORPUS; ls $CORPUS | head -3
echo "=== policy derive k3-tp8"
t python -m harness.cli synth --config k3-tp8 --layers 1-2 --steps 2 --num-spec 3 --requests 1 --experts mxfp4 \
  --seed 1 --device cuda --out /tmp/k3-derive -q
t python -m harness.cli policy derive /tmp/k3-derive --seeds 3 --device cuda --save "$OUT/k3-tp8-h200.json" --update golden/tolerances.toml > "$OUT/derive.log" 2>&1
cp golden/tolerances.toml "$OUT/tolerances_device.toml"
echo "=== replay corpus"
t python benchmarks/bench_replay.py --captures $CORPUS --backend triton --json "$OUT/bench_replay.json" 2>&1 | tee "$OUT/bench_replay.txt" | grep -v "it/s\]" | tail -24
echo "=== replay golden triton"
t python -m harness.cli replay golden --backend triton --device cuda --quiet --report "$OUT/replay_triton_golden.md" | tail -3
