#!/usr/bin/env bash
# The wave-2 benchmarks of docs/benchmarks.md, one at a time on an idle machine: scripts/experiments/wave2_bench.sh b1
set -u
cd "$(dirname "$0")/.."
D=${OUT:-out/wave2}; mkdir -p "$D"
B="python -m dynaspec.cli.main bench"
case "$1" in
  b1) $B compare --a "peer:llamacpp:plain" --b "--quantization auto" --workload code_edit --concurrency 1 --pairs 5 --num-prompts 4 --max-tokens 128 --out $D/b1 ;;
  b2) $B compare --a "--quantization none --attention-backend eager" --b "--quantization auto" --workload code_edit --concurrency 1 --pairs 5 --num-prompts 4 --max-tokens 128 --out $D/b2 ;;
  b3) $B compare --a "peer:llamacpp:plain" --b "--speculator ngram --num-spec-tokens 4" --workload code_edit --concurrency 1 --pairs 5 --num-prompts 4 --max-tokens 128 --out $D/b3 ;;
  b4) $B compare --a "--speculator none" --b "--speculator ngram --num-spec-tokens 4" --workload chat --concurrency 1 --pairs 5 --num-prompts 4 --max-tokens 128 --out $D/b4 ;;
  b5) $B compare --a "--speculator ngram --num-spec-tokens 4 --k-policy table" --b "--speculator ngram --num-spec-tokens 4" --workload code_edit --concurrency 16 --pairs 5 --num-prompts 16 --max-tokens 64 --out $D/b5 ;;
  b6) $B compare --a "--speculator none" --b "--speculator ngram --num-spec-tokens 4" --workload code_edit --concurrency 16 --pairs 5 --num-prompts 16 --max-tokens 64 --out $D/b6 ;;
  b7) $B compare --a "--speculator ngram --num-spec-tokens 8 --k-policy table" --b "--speculator suffix --num-spec-tokens 8 --k-policy table" --workload agentic --num-prompts 6 --max-tokens 64 --concurrency 1 --pairs 5 --out $D/b7 ;;
  b8) $B decode --batch-sizes 16 --context-lens 128,1024 --gen-tokens 32 --attention-backend eager --json > $D/b8_eager.json; $B decode --batch-sizes 16 --context-lens 128,1024 --gen-tokens 32 --json > $D/b8_auto.json ;;
  b9) $B admission --speculator none --max-num-seqs 1 --pairs 10 --steps 20 --out $D/b9_batch1.json ;;
  b10) $B structured --concurrency 1 --num-prompts 4 --pairs 5 --max-tokens 160 ;;
  b11) $B reliability --scenario abort --requests 1000 ;;
  b12) python -m dynaspec.bench.dp_stress --model default --dtype float32 --speculator ngram --num-spec-tokens 3 --max-num-seqs 16 --data-parallel-size 2 --concurrency 7,16 --rounds 3 --requests-per-round 340 --max-tokens 8 ;;
  b13) $B async --concurrency 1,8,32 --pairs 5 --max-tokens 64 --out $D/b13 ;;
  b14) $B async --concurrency 32 --num-prompts 128 --pairs 5 --max-tokens 64 --spec "--speculator ngram --num-spec-tokens 4 --prompt-lookup-min 2 --k-policy table" --out $D/b14 ;;
esac
