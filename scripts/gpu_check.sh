#!/usr/bin/env bash
# One time-boxed device run: the CUDA tests, decode ours vs HF transformers (static cache, then
# static cache + its compile), verify widths, eager vs graphs, then (MODEL_GGUF set) the real
# default model on code-edit prompts, plain vs n-gram. One JSON report, rewritten after every
# stage (dynaspec/bench/gpu_check.py), so a timeout still returns what finished.
# Usage (repository root): OUT=/some/dir [MODEL_GGUF=/root/m/model.gguf] [BUDGET=255] \
#   scripts/gpu_check.sh        DRY_RUN=1: tiny shapes on the CPU (GPU-only parts skip).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DYNASPEC_NO_CPU_KERNELS=1
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
BUDGET="${BUDGET:-255}"
timeout $((${BUDGET%.*} + 10)) python -m dynaspec.bench.gpu_check run --out "$OUT/gpu_check.json" --budget "$BUDGET"
echo "report: $OUT/gpu_check.json"
