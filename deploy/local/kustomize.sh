#!/usr/bin/env bash
# kustomize for the manifest tests: kustomize.sh [--print]
#
# Installs the real kustomize (sigs.k8s.io/kustomize) into .state/bin/ with
# `go install` through the Go module proxy, once: a second run finds it and
# does nothing. tests/deploy/test_kustomize_render.py renders every folder of
# deploy/k8s/ the docs tell users to apply with it. A kustomize already on PATH
# is used as it is. Needs Go (Debian's golang-go is installed when missing);
# KUSTOMIZE_VERSION picks another release (the default builds with Go 1.22+).
# --print: print the binary's path on stdout.
set -euo pipefail
SERVICE=kustomize
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

KUSTOMIZE_VERSION="${KUSTOMIZE_VERSION:-v5.7.1}"
BIN_DIR="$STATE_DIR/bin"

found="$(command -v kustomize || true)"
if [[ -z "$found" && -x "$BIN_DIR/kustomize" ]]; then
    found="$BIN_DIR/kustomize"
fi
if [[ -z "$found" ]]; then
    command -v go >/dev/null || ensure_packages golang-go
    mkdir -p "$BIN_DIR"
    log "installing kustomize $KUSTOMIZE_VERSION into $BIN_DIR (go install)"
    # GOTOOLCHAIN=local: never fetch a newer Go toolchain behind the user's back.
    if ! GOBIN="$BIN_DIR" GOTOOLCHAIN=local go install \
        "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION" >&2; then
        die "go install of kustomize $KUSTOMIZE_VERSION failed"
    fi
    found="$BIN_DIR/kustomize"
fi
"$found" version >/dev/null 2>&1 || die "$found does not run"
if [[ "${1:-}" == "--print" ]]; then
    printf '%s\n' "$found"
fi
