#!/usr/bin/env bash
# One `dynaspec serve` run under load, with perf's context-switch count (docs/benchmarks.md,
# "Wave 3, fourth session"): scripts/experiments/wave3d_serve_ab.sh TAG aiperf|load. Env: TREE (source tree,
# default this one), EXTRA (serve flags), REQS (aiperf requests, default 32), and any
# OMP_WAIT_POLICY / GOMP_SPINCOUNT to try. Run it alone on the idle machine.
set -u
TREE=${TREE:-$(cd "$(dirname "$0")/.." && pwd)}
D=${OUT:-out/wave3d/serve_ab}; mkdir -p "$D"
PYTHONPATH=$TREE python -m dynaspec.cli.main serve --model default --port 8402 ${EXTRA:-} > "$D/server_$1.log" 2>&1 &
SP=$!
for _ in $(seq 120); do curl -s localhost:8402/health >/dev/null && break; sleep 1; done
perf stat -e context-switches,page-faults,task-clock -p $SP -o "$D/perf_$1.txt" &
PP=$!
if [ "$2" = aiperf ]; then
  ${AIPERF:-/tmp/aiperf-venv/bin/aiperf} profile --url http://127.0.0.1:8402 --model default \
    --endpoint-type chat --streaming --tokenizer ${TOKENIZER:-$HOME/.cache/dynaspec-clients/tokenizer-smollm2} \
    --use-server-token-count --concurrency 16 --request-count ${REQS:-32} --isl 230 --osl 48 \
    --extra-inputs ignore_eos:true --workers-max 16 --record-processor-service-count 1 --ui none \
    --no-gpu-telemetry --output-artifact-dir "$D/aiperf_$1" > "$D/aiperf_$1.log" 2>&1
  python -c "
import json, glob
d = json.load(open(glob.glob('$D/aiperf_$1/**/profile_export_aiperf.json', recursive=True)[0]))
print({k: round(d[k]['avg' if k.endswith('throughput') else 'p50'], 1) for k in
       ('output_token_throughput', 'time_to_first_token', 'inter_token_latency')})"
else
  PYTHONPATH=$TREE python -m dynaspec.bench.load_test --url http://127.0.0.1:8402 --concurrency 16 \
    --num-requests 48 --max-tokens 48 --json | tail -1
fi
kill -INT $PP; sleep 1; kill $SP; wait $SP 2>/dev/null
grep -E "context|faults|task" "$D/perf_$1.txt"
