#!/usr/bin/env bash
# After scripts/gpu_eagle.sh came back (issue 48): install the returned head, plot its training,
# measure its acceptance and speed on held-out bench prompts on the CPU. One step at a time, on
# an idle machine for the speed steps:
#   RUN=<the device run's files> scripts/eagle_cpu_checks.sh install|report|accept|c1|c16
#   (c1 and c16 take WL=chat|code_edit; OUT= where bench folders go, default out/w4e)
set -u
cd "$(dirname "$0")/.."
RUN=${RUN:-out/eagle}; D=${OUT:-out/w4e}; WL=${WL:-chat}; mkdir -p "$D"
M="python -m dynaspec.cli.main"
B="$M bench compare --workload $WL"
C1="--concurrency 1 --pairs ${PAIRS:-5} --num-prompts 4 --max-tokens 128"
C16="--concurrency 16 --pairs ${PAIRS:-3} --num-prompts 32 --max-tokens 64"
case "${1:-}" in
  # the head into dynaspec/spec_decode/drafters/heads/smollm2-135m-instruct (checked against the target)
  install) python -m dynaspec.train.install_head "$RUN/head" ;;
  # stage timings, data counts, held-out acceptance; the loss/acceptance figure into docs/
  # (needs matplotlib: pip install 'dynaspec[train]')
  report) python -m dynaspec.train.eagle_report "$RUN/report.json" docs/eagle_gpu_training.png ;;
  # position-1 acceptance and the share of output tokens from accepted drafts, held-out chat and
  # code-edit prompts, against n-gram and suffix (K fixed at 3, token counts only)
  accept) python scripts/experiments/eagle_acceptance.py 16 128 --arms eagle,ngram,suffix \
            --workloads code_edit,chat | tee "$D/acceptance.jsonl" ;;
  # paired speed at concurrency 1, default flags: eagle against plain, n-gram and suffix
  c1) $B --a "--speculator none" --b "--speculator eagle" $C1 --out "$D/c1_none_$WL"
      $B --a "--speculator ngram" --b "--speculator eagle" $C1 --out "$D/c1_ngram_$WL"
      $B --a "--speculator suffix" --b "--speculator eagle" $C1 --out "$D/c1_suffix_$WL" ;;
  # concurrency 16: never below plain beyond noise
  c16) $B --a "--speculator none" --b "--speculator eagle" $C16 --out "$D/c16_none_$WL" ;;
  *) echo "usage: RUN=DIR $0 install|report|accept|c1|c16   (WL=chat|code_edit)"; exit 2 ;;
esac
