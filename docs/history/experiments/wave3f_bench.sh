#!/usr/bin/env bash
# Wave 3, sixth session (docs/benchmarks.md "Wave 3, sixth session"). One at a time on an idle
# machine; the issue targets rerun with OUT=out/wave3f scripts/experiments/wave3e_bench.sh c1|agentic|eagle_code|
# eagle_chat and OUT=out/wave3f scripts/experiments/wave3_bench.sh w3|w6|w7.
set -u
cd "$(dirname "$0")/.."
D=${OUT:-out/wave3f}; mkdir -p "$D"
B="python -m dynaspec.cli.main bench"
N4="--speculator ngram --num-spec-tokens 4"
case "$1" in
  # the goodput policy against always drafting 4, c1 code edits
  goodput_vs_table) $B compare --a "$N4 --k-policy table" --b "$N4" --workload code_edit --concurrency 1 --pairs 5 --num-prompts 4 --max-tokens 128 --out $D/c1_goodput_vs_table ;;
  # step time by verify width (issue 21's ratios)
  decode) $B decode --model default --widths 1,2,3,5,9,16 --batch-sizes 1,4 --context-lens 128,1024 --rounds 5 --json > $D/w1_decode.json ;;
  # the int8 GEMM with weights streamed from memory (30 layers of distinct weights)
  gemm_stream) DYNASPEC_GEMM_LAYERS=30 python scripts/experiments/gemm_ab.py 1,2,5,9,16,64 ;;
  *) echo "usage: $0 goodput_vs_table|decode|gemm_stream"; exit 2 ;;
esac
