#!/usr/bin/env bash
# Create (or check) the real-engine tier's SGLang venv, apart from Narwhal's .venv and vLLM's.
#
#   bash tools/engines/sglang-venv.sh [VENV]
#
# VENV defaults to $NARWHAL_SGLANG_VENV, else ~/.cache/narwhal/sglang-venv ($XDG_CACHE_HOME
# respected): outside the checkout, so clones and CI runs on one machine share one ~3 GB
# venv and install it once per change of the pins (the stamp below).
#
# SGLang on the CPU torch, serving aggregate and real P/D over Mooncake's TCP transfer
# engine (facts: shared/notes/real-sglang.md). sglang itself goes in with --no-deps (its
# requirements are CUDA builds: flashinfer, sgl-kernel, cuda-python...); what it imports is
# pinned by sglang-constraints.txt. Three local CPU workarounds follow, each checked against
# the installed SGLang, which says so when a new version no longer needs one. Re-running
# with the same pins is a no-op once the imports check out. Exits non-zero naming what
# failed; never half-succeeds.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-${NARWHAL_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/narwhal/sglang-venv}}"
python="${PYTHON:-python3}"

SGLANG=0.5.23
# The CPU build of torch; this machine kind ships it as a wheel on disk (PyPI's default
# torch is a CUDA build of several GB).
TORCH=2.13.0
# What SGLang 0.5.23 imports when it serves a text model on CPU (found by importing its
# server, scheduler, model runner, Llama and Mooncake modules until nothing was missing);
# versions come from sglang-constraints.txt. Not sglang-router: Narwhal is the router here.
REQUIRES="
    aiohttp apache-tvm-ffi compressed-tensors dill distro easydict einops fastapi gguf
    interegular ipython jsonschema mooncake-transfer-engine-non-cuda msgspec numpy openai orjson
    packaging partial-json-parser pillow prometheus-client psutil pybase64 pydantic
    python-dateutil python-multipart pyzmq regex requests scipy sentencepiece setproctitle
    soundfile tiktoken tokenizers torchvision transformers triton uvicorn uvloop watchfiles
    xgrammar xxhash zstandard"
# Our CPU workarounds (see below), copied into the venv's site-packages.
CPU="$here/sglang_cpu"

stamp="$venv/.narwhal-stamp"
# The stamp names what is installed (the pins and the workarounds' code), not this
# script's text: editing a comment here must not rebuild a venv engines may run from.
want="$( (printf 'sglang==%s torch==%s\n%s\n' "$SGLANG" "$TORCH" "$REQUIRES"
    cat "$here/sglang-constraints.txt" "$CPU/sitecustomize.py" "$CPU/sgl_kernel/__init__.py" \
        "$CPU/guard_torchvision.py") | sha256sum | cut -d' ' -f1)"

# What the engines import, each on its own in check() so a failure names its module.
modules="torch transformers torchvision triton mooncake.engine sgl_kernel sglang
    sglang.srt.entrypoints.http_server sglang.srt.managers.scheduler
    sglang.srt.model_executor.model_runner sglang.srt.models.llama
    sglang.srt.disaggregation.mooncake.conn"

check() {
    local failed=0 out one module
    # SGLang's modules pick their CPU code paths at import time from this variable.
    if out="$(SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -W ignore -c "
import $(echo $modules | sed 's/ /, /g')
import sglang.srt.disaggregation.mooncake.conn as conn
assert sglang.__version__ == '$SGLANG', f'sglang is {sglang.__version__}; the tier is pinned to $SGLANG'
assert getattr(conn.MooncakeKVSender, 'supports_host_tensor_indices', False) is False, 'the Mooncake workaround (sitecustomize) did not apply'
" 2>&1)"; then
        return 0
    fi
    for module in $modules; do
        if ! one="$(SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -W ignore -c "import $module" 2>&1)"; then
            echo "sglang-venv: 'import $module' failed in $venv:" >&2
            echo "$one" | tail -5 >&2
            failed=1
        fi
    done
    if [ "$failed" = 0 ]; then
        echo "sglang-venv: $venv imports, but:" >&2
        echo "$out" | tail -3 >&2
    fi
    return 1
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && check; then
    echo "sglang-venv: $venv is ready (sglang $SGLANG)"
    exit 0
fi

# Mooncake's transfer engine links libibverbs even for TCP. CI runs as root; apt's package
# lists are fetched only when the install fails without them.
if ! ldconfig -p | grep 'libibverbs\.so\.1 ' >/dev/null; then
    echo "sglang-venv: installing Debian's libibverbs1 (Mooncake's transfer engine links it)"
    if ! { apt-get install -y -qq libibverbs1 || { apt-get update -qq && apt-get install -y -qq libibverbs1; }; } >/dev/null 2>&1; then
        echo "sglang-venv: could not install libibverbs1 (apt-get install -y libibverbs1, as root)" >&2
        exit 1
    fi
fi

# This machine's pip configuration lists local indexes that lack most packages; pip warns
# once per package about each. Keep the rest of what pip says.
pip() {
    "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v -e "^WARNING: Location '" -e "^sglang $SGLANG requires" || true; }
}

started=$SECONDS
if [ -x "$venv/bin/python" ] && check 2>/dev/null; then
    # A working venv made with other pins: install the pins into it rather than delete it,
    # since engines may be running from it.
    echo "sglang-venv: $venv works but is not stamped with these pins; installing them into it"
else
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    pip install --quiet --upgrade pip
fi
# shellcheck disable=SC2086
pip install --quiet -c "$here/sglang-constraints.txt" "torch==$TORCH" $REQUIRES
pip install --quiet --no-deps "sglang==$SGLANG"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
src="$site/sglang"

# Workaround 1: sgl_kernel. PyPI's sgl-kernel and sglang-kernel are CUDA builds; with
# SGLANG_USE_CPU_ENGINE=1, SGLang imports `*_cpu` kernels from `sgl_kernel` when its modules
# load, and on a CPU without AMX the text path calls one of them. Our stand-in provides that
# one in plain torch and fails loudly on any other (tools/engines/sglang_cpu/sgl_kernel).
# CHECKED: SGLang still imports sgl_kernel, and that function from it.
if ! grep -rqs --include='*.py' -e '^ *from sgl_kernel import' -e '^ *import sgl_kernel' "$src"; then
    echo "sglang-venv: NOTE: sglang $SGLANG imports no sgl_kernel: the stand-in is no longer needed"
elif ! grep -rqs --include='*.py' 'from sgl_kernel import assign_req_to_token_pool_cpu' "$src"; then
    echo "sglang-venv: NOTE: sglang $SGLANG no longer imports assign_req_to_token_pool_cpu from sgl_kernel; see what its CPU path calls now" >&2
fi
rm -rf "$site/sgl_kernel"
cp -r "$CPU/sgl_kernel" "$site/sgl_kernel"

# Workaround 2: torchvision. PyPI's torchvision is built against CUDA torch: its _C.so does
# not load on the CPU torch, and the two `register_fake` decorators in
# torchvision/_meta_registrations.py then fail the import ("operator torchvision::nms does
# not exist"). SGLang imports torchvision at start-up (its multimodal config modules), so
# it cannot be left out; guarding those two decorators as torchvision guards its others
# (`extension._has_ops()`) is enough for a text model.
# CHECKED: torchvision fails to import unpatched (else the patch is skipped, saying so).
meta="$site/torchvision/_meta_registrations.py"
if grep -qs 'if torchvision.extension._has_ops() else (lambda fn: fn))$' "$meta"; then
    : # guarded by an earlier run (pip kept the installed torchvision)
elif "$venv/bin/python" -c 'import torchvision' >/dev/null 2>&1; then
    echo "sglang-venv: NOTE: torchvision imports on the CPU torch unpatched: the guard is no longer needed"
else
    "$venv/bin/python" "$CPU/guard_torchvision.py" "$meta"
fi

# Workaround 3: Mooncake's prefill sender. SGLang's MooncakeKVSender declares
# supports_host_tensor_indices = True, which makes the prefill scheduler pin memory and
# record a torch.cuda.Event for each send: on CPU the prefill scheduler dies on its first
# P/D request. Our sitecustomize sets it False when that module is imported, and the
# generic path the other backends use runs instead.
# CHECKED: the attribute is still True in this SGLang (check() then asserts it is False
# once patched).
if ! grep -qs '^    supports_host_tensor_indices = True' "$src/srt/disaggregation/mooncake/conn.py"; then
    echo "sglang-venv: NOTE: sglang $SGLANG's MooncakeKVSender no longer sets supports_host_tensor_indices = True: the sitecustomize workaround is no longer needed"
fi
cp "$CPU/sitecustomize.py" "$site/sitecustomize.py"

if ! check; then
    echo "sglang-venv: $venv does not work; see the errors above" >&2
    exit 1
fi
echo "$want" > "$stamp"
echo "sglang-venv: $venv ready in $((SECONDS - started)) s (sglang $SGLANG)"
