#!/usr/bin/env bash
# The session's device calls, back to back while the machine stays warm (~30 s): the default
# model's GGUF (98 MB) is over one call's 64 MiB, so call `a` brings its first half and runs the
# checks that need no real weights, call `b` brings the second half, reassembles and checks the
# sha256, then trains the EAGLE head and runs the real-model stage.
#   a: mkdir -p .carryA && cp part00 .carryA/   run(carry=[".carryA", ".whl"], "bash scripts/gpu_session.sh a")
#   b: mkdir -p .carryB && cp part01 .carryB/   run(carry=[".carryB", ".whl"], "bash scripts/gpu_session.sh b")
# (.carryA, .carryB and .whl are listed in .git/info/exclude; .whl holds the gguf wheel.)
set -u
cd "$(dirname "$0")/.."
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p /root/m "$OUT"
case "${1:-}" in
  a)
    cp .carryA/part00 /root/m/part00
    nvidia-smi -L
    # The CPU kernels on this host's CPU (issue 47): built in the background while the GPU
    # correctness tests run, tested after the timed stages.
    (grep -m1 "model name" /proc/cpuinfo; grep -m1 flags /proc/cpuinfo | tr ' ' '\n' \
      | grep -E "^(avx2|avx512.*|avx_vnni|amx.*)$" | tr '\n' ' '; echo) > "$OUT/cpu_kernels.txt"
    (DYNASPEC_CACHE_DIR=/tmp/dsk MAX_JOBS=16 PYTHONPATH=$PWD:/tmp/site timeout 200 python3 -c \
      "from dynaspec import cpu_kernels as c; print('kernels', c.available())" \
      >> "$OUT/cpu_kernels.txt" 2>&1 &)
    OUT=$OUT BUDGET=270 bash scripts/gpu_check.sh
    DYNASPEC_CACHE_DIR=/tmp/dsk PYTHONPATH=$PWD:/tmp/site timeout 60 python3 -m pytest -q \
      -p no:cacheprovider tests/model/test_int8_dot.py tests/unit/test_cpu_features.py \
      >> "$OUT/cpu_kernels.txt" 2>&1
    tail -5 "$OUT/cpu_kernels.txt"
    ;;
  b)
    cp .carryB/part01 /root/m/part01
    cat /root/m/part00 /root/m/part01 > /root/m/model.gguf
    got=$(sha256sum /root/m/model.gguf | cut -c1-64)
    echo "gguf sha256 $got"; [ "$got" = "$SHA" ] || { echo "sha256 mismatch"; exit 3; }
    TOTAL_S=${TOTAL_S:-330} MODEL_GGUF=/root/m/model.gguf OUT=$OUT bash scripts/gpu_eagle.sh
    PYTHONPATH=$PWD:/tmp/site DYNASPEC_NO_CPU_KERNELS=1 MODEL_GGUF=/root/m/model.gguf timeout 80 \
      python3 -m dynaspec.bench.gpu_check stage real --out /tmp/real.json \
      --deadline $(( $(date +%s) + 70 ))
    echo "REAL_JSON"; cat /tmp/real.json; echo
    ;;
  *) echo "usage: $0 a|b"; exit 2 ;;
esac
