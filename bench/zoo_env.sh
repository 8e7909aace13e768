#!/usr/bin/env bash
# Third-party model code for bench/zoo.py (torchvision, timm), kept OUT of the venv's
# site-packages: transformers imports torchvision whenever it can, and the index's torchvision
# is a CUDA build whose C ops do not exist on the CPU torch ("operator torchvision::nms does not
# exist"). bench/zoo.py puts bench/.zoo-site on sys.path itself and registers the two missing
# operator schemas before importing them.
#
#   bash bench/zoo_env.sh              # wheels from /tmp/whl if there, else from the index
#   WHEELS=DIR bash bench/zoo_env.sh   # wheels from DIR
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-$here/../.venv/bin/python}"
[ -x "$py" ] || py="$(command -v python || command -v python3)"  # no .venv: the active Python
site="$here/.zoo-site"
wheels="${WHEELS:-/tmp/whl}"
pkgs=(torchvision==0.28.0 timm==1.0.31)
if ls "$wheels"/torchvision-0.28.0-*.whl "$wheels"/timm-1.0.31-*.whl >/dev/null 2>&1; then
  pkgs=("$wheels"/torchvision-0.28.0-*.whl "$wheels"/timm-1.0.31-*.whl)
fi
# --no-deps: torch, numpy, pillow, pyyaml, huggingface_hub and safetensors come from the venv.
"$py" -m pip install --no-deps --upgrade --target "$site" "${pkgs[@]}"
"$py" - "$site" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import torch
lib = torch.library.Library("torchvision", "DEF")
lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
import torchvision, timm
print(f"bench/.zoo-site: torchvision {torchvision.__version__}, timm {timm.__version__}")
PY
