#!/usr/bin/env bash
# Installs vllm-router 0.1.x (PyPI `vllm-router`, a Rust binary wheel) into its own venv
# under runs/tmp/ (git-ignored; never committed), for the benchmarks' peer runs: goodput.py
# and goodput_rate.py use it, overhead.py installs the same venv itself when it is missing
# (benchkit.harness.VLLM_ROUTER_VENV and VLLM_ROUTER_REQUIREMENT say the same).
#   bash tools/bench/install_vllm_router.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${1:-runs/tmp/venv-vllm-router}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet 'vllm-router>=0.1,<0.2'
"$venv/bin/python" -c 'import importlib.metadata as m; print("vllm-router", m.version("vllm-router"))'
