#!/usr/bin/env bash
# Wave 3, eleventh session: the EAGLE head's drafting as C++ calls (issue 27), default flags
# otherwise. One at a time on an idle machine:
#   OUT=out/w3k WL=code_edit|chat scripts/experiments/wave3k_bench.sh eagle|eagle_table|hybrid_vs_ngram|eagle_c16
set -u
cd "$(dirname "$0")/.."
D=${OUT:-out/w3k}; mkdir -p "$D"
WL=${WL:-code_edit}
B="python -m dynaspec.cli.main bench compare"
E="--speculator eagle --num-spec-tokens 3"
C1="--workload $WL --concurrency 1 --pairs ${PAIRS:-3} --num-prompts 4 --max-tokens 128"
case "$1" in
  eagle) $B --a "--speculator none" --b "$E" $C1 --out $D/eagle_$WL ;;
  eagle_table) $B --a "--speculator none" --b "$E --k-policy table" $C1 --out $D/eagle_table_$WL ;;
  hybrid_vs_ngram) $B --a "--speculator ngram --num-spec-tokens 3" --b "$E --eagle-lookup ngram" $C1 --out $D/hvn_$WL ;;
  eagle_c16) $B --a "--speculator none" --b "$E" --workload $WL --concurrency 16 --pairs 2 --num-prompts 32 --max-tokens 64 --out $D/eagle_c16_$WL ;;
  *) echo "usage: $0 eagle|eagle_table|hybrid_vs_ngram|eagle_c16 (WL=code_edit|chat)"; exit 2 ;;
esac
