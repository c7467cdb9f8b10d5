# confirmation run (FASTT v6b): bench_fast with TUNE as committed (+ one sweep variant), then both replays
O=$OUT
timeout 90 python benchmarks/bench_fast.py --no-tune --sweep "x1_sload=True,x2_sload=True" --sweep-cases 8x4 --json $O/bench.json > $O/bench.txt 2>&1; echo "[bench rc=$?]" >> $O/bench.txt
T="import json,os,sys; from fast.triton.tuning import TUNE; p=sys.argv[1]; os.path.exists(p) and TUNE.update(json.load(open(p))['tune']); print('TUNE', TUNE, file=sys.stderr); from harness import cli; sys.exit(cli.main(sys.argv[2:]))"
s=$(date +%s)
timeout 140 sh -c "python -m harness.cli synth --config k3-tp8 --layers 1 --steps 1 --num-spec 3 --requests 1 --experts mxfp4 --device cuda --out /tmp/caps -q && python -c \"$T\" $O/bench.json replay /tmp/caps --backend triton --device cuda --isolate --quiet --report $O/replay_k3_isolate.md" > $O/replay_k3.txt 2>&1; echo "[k3-tp8 isolate rc=$? $(( $(date +%s) - s ))s]" >> $O/replay_k3.txt
s=$(date +%s)
timeout 40 python -c "$T" $O/bench.json replay golden --backend triton --device cuda --quiet --report $O/replay_golden.md > $O/replay_golden.txt 2>&1; echo "[golden rc=$? $(( $(date +%s) - s ))s]" >> $O/replay_golden.txt
