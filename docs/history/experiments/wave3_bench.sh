#!/usr/bin/env bash
# The wave-3 benchmarks of docs/benchmarks.md, one at a time on an idle machine: scripts/experiments/wave3_bench.sh w1
set -u
cd "$(dirname "$0")/.."
D=${OUT:-out/wave3}; mkdir -p "$D"
B="python -m dynaspec.cli.main bench"
W="--widths 1,2,3,4,5,8,9,16 --batch-sizes 1,4,16 --context-lens 128,1024 --rounds 5"
case "$1" in
  # verify width: step time per (batch, context, width), int8dot (default) and torch's int4 path
  w1) $B decode --model default $W --json > $D/w1_int8dot.json; $B decode --model default $W --linear-kernel torch --json > $D/w1_torch.json ;;
  # library candidates on the model's shapes
  w2) PYTHONPATH=/tmp/taolib python scripts/experiments/kernel_candidates.py > $D/w2_candidates.txt ;;
  w4b) $B compare --a "peer:llamacpp:plain" --b "--speculator ngram --num-spec-tokens 4" --workload code_edit --concurrency 1 --pairs 5 --num-prompts 4 --max-tokens 128 --out $D/w4b ;;
  # plain decode against llama-cpp-python, same Q4_1 file, paired
  w3) $B compare --a "peer:llamacpp:plain" --b "--speculator none" --workload code_edit --concurrency 1 --pairs 5 --num-prompts 4 --max-tokens 128 --ignore-eos --out $D/w3 ;;
  # speculation at concurrency 1, default flags
  w4) $B compare --a "--speculator none" --b "--speculator ngram --num-spec-tokens 4" --workload code_edit --concurrency 1 --pairs 5 --num-prompts 4 --max-tokens 128 --out $D/w4 ;;
  w5) $B compare --a "--speculator none" --b "--speculator suffix --num-spec-tokens 8" --workload agentic --concurrency 1 --pairs 5 --num-prompts 6 --max-tokens 64 --out $D/w5 ;;
  # under load, default flags
  w6) $B compare --a "--speculator none" --b "--speculator ngram --num-spec-tokens 4" --workload code_edit --concurrency 16 --pairs 5 --num-prompts 16 --max-tokens 64 --out $D/w6 ;;
  w7) $B compare --a "--speculator none" --b "--speculator ngram --num-spec-tokens 4" --workload code_edit --concurrency 64 --pairs 5 --num-prompts 64 --max-tokens 32 --out $D/w7 ;;
  # accuracy: top-1 against the fp32 reference over 2,000 positions
  w8) python scripts/experiments/accuracy_check.py 2000 > $D/w8_accuracy.txt ;;
  # batch-1 step: C++ layer stack vs the Python layer loop (same kernels), profile of the step
  w9) python scripts/experiments/step_overhead.py > $D/w9_overhead.txt ;;
esac
