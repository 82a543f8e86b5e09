#!/usr/bin/env bash
# mypy (strict, config from pyproject.toml) over the installed package layout.
#
# setuptools maps relay/, consumer/ and schema/ into outboxkit.*, which mypy
# cannot follow, so mirror that layout with symlinks in build/typecheck/ and
# check the mirror. Extra arguments are passed to mypy. Runs from any cwd.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"

tree=build/typecheck/outboxkit
rm -rf build/typecheck
mkdir -p "$tree"
shopt -s nullglob dotglob
for entry in outboxkit/*; do
    base="$(basename "$entry")"
    [[ "$base" == __pycache__ ]] && continue
    ln -s "$REPO_ROOT/$entry" "$tree/$base"
done
for sub in relay consumer schema; do
    [[ -e "$tree/$sub" ]] && { echo "typecheck: outboxkit/$sub clashes with ./$sub" >&2; exit 1; }
    ln -s "$REPO_ROOT/$sub" "$tree/$sub"
done

targets=("$tree")
# Test helpers, the benchmark and the chaos harness are typed too.
[[ -d tests/support ]] && targets+=(tests/support)
[[ -d bench ]] && targets+=(bench)
[[ -d chaos ]] && targets+=(chaos)
# Each worked example is a folder of top-level modules, checked on its own path.
for example in examples/*/; do
    [[ -d "$example" ]] && targets+=("$example")
done
# The interpreter test.sh installs into: PYTHON, else the active virtual
# environment, else the project's .venv/ (see use_python in lib.sh), else python3.
py="${PYTHON:-}"
if [[ -z "$py" && -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
    py="$VIRTUAL_ENV/bin/python"
fi
if [[ -z "$py" && -x "${OUTBOXKIT_VENV:-$REPO_ROOT/.venv}/bin/python" ]]; then
    py="${OUTBOXKIT_VENV:-$REPO_ROOT/.venv}/bin/python"
fi
exec "${py:-python3}" -m mypy "$@" "${targets[@]}"
