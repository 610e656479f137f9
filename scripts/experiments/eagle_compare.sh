#!/usr/bin/env bash
# The EAGLE head against no speculation and against a lookup drafter, paired (the EAGLE rows
# of docs/results/speculation.md):
#   WL=code_edit|chat scripts/experiments/eagle_compare.sh eagle|hybrid|eagle_table|hybrid_vs_ngram|eagle_c16
# eagle: the head (goodput K) against none at c1; hybrid: the head behind an n-gram lookup
# against none; eagle_table: the head drafting K=3 every step; hybrid_vs_ngram: the head behind
# an n-gram lookup against n-gram alone; eagle_c16: the head at concurrency 16.
# Env: WL, PAIRS, OUT, HEAD (a head folder other than the shipped one).
# Run it alone on an idle machine.
set -u
cd "$(dirname "$0")/../.."
D=${OUT:-out/eagle_compare}; mkdir -p "$D"
WL=${WL:-code_edit}
B="python -m dynaspec.cli.main bench compare"
E="--speculator eagle --num-spec-tokens 3 ${HEAD:+--draft-head $HEAD}"
C1="--workload $WL --concurrency 1 --pairs ${PAIRS:-3} --num-prompts 4 --max-tokens 128"
case "${1:-}" in
  eagle) $B --a "--speculator none" --b "$E" $C1 --out $D/eagle_$WL ;;
  hybrid) $B --a "--speculator none" --b "$E --eagle-lookup ngram" $C1 --out $D/hybrid_$WL ;;
  eagle_table) $B --a "--speculator none" --b "$E --k-policy table" $C1 --out $D/eagle_table_$WL ;;
  hybrid_vs_ngram) $B --a "--speculator ngram --num-spec-tokens 3" --b "$E --eagle-lookup ngram" $C1 --out $D/hvn_$WL ;;
  eagle_c16) $B --a "--speculator none" --b "$E" --workload $WL --concurrency 16 --pairs ${PAIRS:-2} --num-prompts 32 --max-tokens 64 --out $D/eagle_c16_$WL ;;
  *) echo "usage: $0 eagle|hybrid|eagle_table|hybrid_vs_ngram|eagle_c16 (WL=code_edit|chat, HEAD=dir)"; exit 2 ;;
esac
