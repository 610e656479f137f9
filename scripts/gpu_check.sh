#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the CUDA-marked tests and a short decode bench, < 10 minutes.
# Usage: scripts/gpu_check.sh   (after README command 1)
set -u
cd "$(dirname "$0")/.."
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
timeout 420 python -m pytest -q -m cuda tests/cuda -rs
timeout 150 python -m dynaspec.cli.main bench decode --model default --device cuda --batch-sizes 1,16 --gen-tokens 32
