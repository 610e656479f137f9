#!/usr/bin/env bash
# dynaspec against llama-cpp-python on the same Q4_1 GGUF file, concurrency 1, code edits,
# paired (the llama.cpp rows of docs/results/cpu-decode.md and speculation.md):
#   scripts/experiments/against_llama_cpp.sh plain|ngram
# plain: plain decode in both, ignore_eos; ngram: our default flags with n-gram K=4 against
# llama.cpp's plain decode. Needs llama-cpp-python (pip install llama-cpp-python). Env: PAIRS, OUT.
# Run it alone on an idle machine.
set -u
cd "$(dirname "$0")/../.."
D=${OUT:-out/against_llama_cpp}; mkdir -p "$D"
B="python -m dynaspec.cli.main bench compare"
C1="--workload code_edit --concurrency 1 --pairs ${PAIRS:-5} --num-prompts 4 --max-tokens 128"
case "${1:-}" in
  plain) $B --a "peer:llamacpp:plain" --b "--speculator none" $C1 --ignore-eos --out $D/plain ;;
  ngram) $B --a "peer:llamacpp:plain" --b "--speculator ngram --num-spec-tokens 4" $C1 --out $D/ngram ;;
  *) echo "usage: $0 plain|ngram"; exit 2 ;;
esac
