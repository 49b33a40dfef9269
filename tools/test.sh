#!/usr/bin/env bash
# The one test command (README "Run the tests"; CI calls exactly this).
#
#   bash tools/test.sh [--no-real] [PYTEST ARGS...]
#
# Creates ./.venv if needed, installs Narwhal with its test extras from the package
# registries, lints and type-checks, checks the Prometheus rules (installing promtool
# with apt-get if needed), installs etcd with apt-get if needed (tests/cluster runs real
# etcd), creates the real engines' venvs if needed
# (tools/engines/vllm-venv.sh and sglang-venv.sh, in ~/.cache/narwhal), then runs the
# suite: the fast tier first, the real-engine tier (tests/real, real vLLM engines, then
# real SGLang engines) last. `--no-real` skips the real tier, for quick local runs; CI
# never passes it. Other args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
real=1
args=()
for arg in "$@"; do
    if [ "$arg" = "--no-real" ]; then
        real=0
    else
        args+=("$arg")
    fi
done
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test]'
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# promtool (Debian's `prometheus` package) checks conf/prometheus; tests/release requires it.
if ! command -v promtool >/dev/null; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -q
    $sudo apt-get install -y -q --no-install-recommends prometheus
fi
promtool check rules conf/prometheus/*.rules.yml
# etcd (Debian's `etcd-server` package, etcd 3.4): tests/cluster runs real etcd clusters.
if ! command -v etcd >/dev/null; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -q
    $sudo apt-get install -y -q --no-install-recommends etcd-server
fi
if [ "$real" = 0 ]; then
    exec .venv/bin/pytest -m "not slow and not real" "${args[@]}"
fi
# A failed install fails the run here, saying why; the tier never skips silently. The two
# venvs install side by side (each pip unpacks on one core): a minute less from a warm cache.
bash tools/engines/vllm-venv.sh &
vllm=$!
bash tools/engines/sglang-venv.sh &
sglang=$!
failed=0
wait "$vllm" || failed=1
wait "$sglang" || failed=1
[ "$failed" = 0 ] || exit 1
exec .venv/bin/pytest "${args[@]}"
