#!/usr/bin/env bash
# `pip install .` as a user runs it, in throwaway clones and venvs (not part of tools/test.sh:
# it builds from the package registries twice, about a minute).
#
#   bash tools/check-install.sh [REF]      (default HEAD)
#
# 1. a clone without tags (CI's): installs, and every command answers --version with a
#    0.1.devN+g<hash> version;
# 2. the same clone tagged v0.1.0: every command answers 0.1.0.
# Fails with the command and its output on the first difference.
set -euo pipefail
cd "$(dirname "$0")/.."
ref="${1:-HEAD}"
python="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
commands="$("$python" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["scripts"])')"

check() {  # check LABEL EXPECTED_VERSION_REGEX
    local venv="$tmp/venv-$1"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "$tmp/clone"
    for command in $commands; do
        # Only the venv's bin on PATH: the command must be found there by name.
        out="$(env -i PATH="$venv/bin:/usr/bin:/bin" "$command" --version)" || {
            echo "check-install ($1): $command --version failed: $out" >&2; exit 1; }
        if ! [[ "$out" =~ ^$command\ $2$ ]]; then
            echo "check-install ($1): $command --version printed '$out'" >&2
            exit 1
        fi
        echo "check-install ($1): $out"
    done
}

git clone --quiet --no-tags --no-local . "$tmp/clone"
git -C "$tmp/clone" checkout --quiet "$(git rev-parse "$ref")"
check untagged '0\.1\.dev[0-9]+\+g[0-9a-f]+'
git -C "$tmp/clone" -c user.name=check -c user.email=check@localhost tag -a v0.1.0 -m v0.1.0
check tagged '0\.1\.0'
