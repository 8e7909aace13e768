#!/usr/bin/env bash
# Re-make the golden traces: CPU fp32, one training step of each built-in model.
#   bash golden/make.sh
# The tests re-record each model from its golden replay and compare against it (tests/test_golden.py).
set -euo pipefail
cd "$(dirname "$0")"
for model in mlp resnet llama vit; do
  TORCH_DEVICE_BACKEND_AUTOLOAD=0 OMP_NUM_THREADS=1 driftcheck --quiet record "$model" --out "$model" --steps 1 --force
done
du -sh ./*/ | sort -k2
