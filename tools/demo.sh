#!/usr/bin/env bash
# The demo (README "Run the demo"): a simulated fleet, the router, a short workload, a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet -e .
exec .venv/bin/python -m narwhal.demo "$@"
