#!/usr/bin/env bash
# Wave 3, tenth session: the EAGLE drafter at c1 (issue 27), default flags otherwise. One at a
# time on an idle machine:
#   OUT=out/w3j WL=code_edit|chat scripts/experiments/wave3j_bench.sh eagle|hybrid|hybrid_vs_ngram|hybrid_vs_suffix
# HEAD=DIR runs a head other than the shipped one (--draft-head).
set -u
cd "$(dirname "$0")/.."
D=${OUT:-out/w3j}; mkdir -p "$D"
WL=${WL:-code_edit}
B="python -m dynaspec.cli.main bench compare"
H=${HEAD:+--draft-head $HEAD}
E="--speculator eagle --num-spec-tokens 3 $H"
C1="--workload $WL --concurrency 1 --pairs ${PAIRS:-3} --num-prompts 4 --max-tokens 128"
case "$1" in
  eagle) $B --a "--speculator none" --b "$E" $C1 --out $D/eagle_$WL ;;
  hybrid) $B --a "--speculator none" --b "$E --eagle-lookup ngram" $C1 --out $D/hybrid_$WL ;;
  hybrid_vs_ngram) $B --a "--speculator ngram --num-spec-tokens 3" --b "$E --eagle-lookup ngram" $C1 --out $D/hybrid_vs_ngram_$WL ;;
  hybrid_vs_suffix) $B --a "--speculator suffix --num-spec-tokens 8" --b "$E --eagle-lookup ngram" $C1 --out $D/hybrid_vs_suffix_$WL ;;
  c16) $B --a "--speculator none" --b "$E --eagle-lookup ngram" --workload $WL --concurrency 16 --pairs 2 --num-prompts 32 --max-tokens 64 --out $D/hybrid_c16_$WL ;;
  *) echo "usage: $0 eagle|hybrid|hybrid_vs_ngram|hybrid_vs_suffix|c16 (WL=code_edit|chat, HEAD=dir)"; exit 2 ;;
esac
