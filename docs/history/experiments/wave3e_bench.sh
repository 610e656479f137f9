#!/usr/bin/env bash
# Wave 3, fifth session: the goodput policy's draft-length pricing and whole caps for suffix
# drafts (docs/benchmarks.md "Wave 3, fifth session"). One at a time on an idle machine:
#   OUT=out/wave3e scripts/experiments/wave3e_bench.sh agentic_vs_table
set -u
cd "$(dirname "$0")/.."
D=${OUT:-out/wave3e}; mkdir -p "$D"
B="python -m dynaspec.cli.main bench compare"
S8="--speculator suffix --num-spec-tokens 8"
AG="--workload agentic --concurrency 1 --num-prompts 6"
case "$1" in
  # the policy's choice against always drafting up to 8 (the table), the workload's own budgets
  agentic_vs_table) $B --a "$S8 --k-policy table" --b "$S8" $AG --pairs 5 --out $D/agentic_table_vs_goodput ;;
  # issue 21's agentic target: suffix (default flags) against no speculation
  agentic) $B --a "--speculator none" --b "$S8" $AG --pairs 5 --out $D/agentic_goodput_vs_none ;;
  agentic64) $B --a "--speculator none" --b "$S8" $AG --pairs 5 --max-tokens 64 --out $D/agentic64 ;;
  # n-gram at c1 (issue 21's >= 1.3x), as scripts/experiments/wave3c_bench.sh c1
  c1) $B --a "--speculator none" --b "--speculator ngram --num-spec-tokens 4" --workload code_edit --concurrency 1 --pairs 5 --num-prompts 4 --max-tokens 128 --out $D/c1_ngram ;;
  # suffix under load (issue 21: never below no speculation beyond noise)
  agentic_c16) $B --a "--speculator none" --b "$S8" --workload agentic --concurrency 16 --pairs 3 --num-prompts 18 --max-tokens 64 --out $D/agentic_c16 ;;
  # the retrained EAGLE head against no speculation at c1 (issue 27), default flags
  eagle_code) $B --a "--speculator none" --b "--speculator eagle --num-spec-tokens 3" --workload code_edit --concurrency 1 --pairs 3 --num-prompts 4 --max-tokens 128 --out $D/eagle_code ;;
  eagle_chat) $B --a "--speculator none" --b "--speculator eagle --num-spec-tokens 3" --workload chat --concurrency 1 --pairs 3 --num-prompts 4 --max-tokens 128 --out $D/eagle_chat ;;
  *) echo "usage: $0 agentic_vs_table|agentic|agentic64|agentic_c16|c1|eagle_code|eagle_chat (under load: scripts/experiments/wave3_bench.sh w6 w7)"; exit 2 ;;
esac
