#!/usr/bin/env bash
# Install the Toxiproxy server (idempotent) and print its path on stdout:
#   chaos/toxiproxy.sh
# Built with `go install` into chaos/.bin (git-ignored); a second call returns at once.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN_DIR="$HERE/.bin"
VERSION="${TOXIPROXY_VERSION:-v2.12.0}"
TARGET="$BIN_DIR/toxiproxy-server-$VERSION"
if [[ -x "$TARGET" ]]; then
    echo "$TARGET"
    exit 0
fi
PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "go is needed to build toxiproxy (golang.org/dl)" >&2; exit 1; }
mkdir -p "$BIN_DIR"
echo "[chaos] building toxiproxy $VERSION with go install" >&2
# A folder of this call's own, then one rename: two runs building at once (the
# suite's two chaos smoke runs on two workers) each install a whole binary.
GOBIN="$(mktemp -d "$BIN_DIR/gobin.XXXXXX")"
trap 'rm -rf "$GOBIN"' EXIT
GOBIN="$GOBIN" go install "github.com/Shopify/toxiproxy/v2/cmd/server@$VERSION" >&2
mv -f "$GOBIN/server" "$TARGET"
echo "$TARGET"
