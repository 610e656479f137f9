#!/usr/bin/env bash
# The EAGLE-3 head for the default model in one call on one GPU (issue 48): the target answers
# ~10^5 prompts, the head trains on them, held-out acceptance is measured; about 6.5 minutes.
#   MODEL_GGUF=/root/m/model.gguf OUT=$OUT scripts/gpu_eagle.sh
#   DRY_RUN=1 OUT=/tmp/eagle-dry scripts/gpu_eagle.sh        # tiny shapes on the CPU, < 3 minutes
# Writes to $OUT (at most 8 files): report.json (after every stage), answers-{0..3}.npz,
# head/config.json, head/model-0000{1,2}-of-00002.safetensors. Stages are time-boxed inside
# (dynaspec/train/eagle_recipe.py); `timeout` is the last resort.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DYNASPEC_NO_CPU_KERNELS=1
export OUT="${OUT:-out/eagle}" MODEL_GGUF="${MODEL_GGUF:-/root/m/model.gguf}"
mkdir -p "$OUT"
if [ -z "${DRY_RUN:-}" ] || [ "${DRY_RUN}" = 0 ]; then
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
  [ -f "$MODEL_GGUF" ] && ls -l "$MODEL_GGUF"
fi
timeout -k 5 "$(( ${TOTAL_S:-375} + 20 ))" python -m dynaspec.train.eagle_recipe
rc=$?
echo "eagle recipe exit $rc"
find "$OUT" -type f -exec ls -l {} \;
exit $rc
