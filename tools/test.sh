#!/usr/bin/env bash
# The one test command (README "Run the tests"; CI calls exactly this).
# Creates ./.venv if needed, installs Narwhal with its test extras from the package
# registries, then lints, type-checks and runs the suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test]'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/pytest "$@"
