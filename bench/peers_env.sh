#!/usr/bin/env bash
# msProbe (mindstudio-probe, Huawei's precision debugger) for bench/peers.py, kept OUT of the
# venv's site-packages: a bench-only dependency, never a core one. bench/peers.py appends
# bench/.peers-site to sys.path after the venv's own packages (the venv's torch and numpy win).
#
#   bash bench/peers_env.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-$here/../.venv/bin/python}"
site="$here/.peers-site"
"$py" -m pip install --upgrade --target "$site" mindstudio-probe==26.2.0
"$py" - "$site" <<'PY'
import sys
sys.path.append(sys.argv[1])
import msprobe.pytorch  # noqa: F401
from importlib.metadata import version
print(f"bench/.peers-site: mindstudio-probe {version('mindstudio-probe')}")
PY
