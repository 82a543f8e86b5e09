#!/usr/bin/env bash
# Build the outboxkit image without a Docker engine, with buildah (Debian's
# package), and print the image id on stdout:
#
#   deploy/docker/build.sh      # -> localhost/outboxkit:<version>, localhost/outboxkit:dev
#   OUTBOXKIT_IMAGE=localhost/outboxkit:try deploy/docker/build.sh   # that name only
#
# <version> is the package version, read from pyproject.toml (the one source;
# `outboxkit --version` prints the same). buildah and podman store an
# unqualified name under localhost/, so `outboxkit:<version>` in
# deploy/compose and deploy/k8s names this image. The image carries the OCI
# labels org.opencontainers.image.version (that version), .source (the
# repository: OUTBOXKIT_SOURCE_URL, else pyproject's [project.urls], else the
# git remote `origin` without credentials), .revision (the git commit) and
# .licenses (Apache-2.0).
#
# 1. base: a Debian bookworm root file system made by mmdebstrap from Debian's
#    own packages (python3, pip, venv), committed once as
#    localhost/outboxkit-base:bookworm and reused afterwards (kept in buildah's
#    image store, so every checkout on the machine shares it);
# 2. image: deploy/docker/Dockerfile built with PYTHON_IMAGE=<that base>, the
#    same file that builds on python:3.11-slim with Docker. Layers are cached:
#    a second run with nothing changed takes seconds.
#
# The host's CA bundle and pip configuration are bind-mounted into the build
# (never copied into a layer): this machine reaches its package index through
# them. Progress goes to stderr, one line per step; the tools' output goes to
# deploy/docker/.build/*.log.
set -euo pipefail
SERVICE=image
# shellcheck source=../local/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../local/lib.sh"

REPO_ROOT="$(cd "$LOCAL_DIR/../.." && pwd)"
BUILD_DIR="$REPO_ROOT/deploy/docker/.build"
BASE_IMAGE="${OUTBOXKIT_BASE_IMAGE:-localhost/outboxkit-base:bookworm}"
mkdir -p "$BUILD_DIR"

# The package version and the repository's address, from pyproject.toml.
read_project() {
    python3 - "$REPO_ROOT/pyproject.toml" "$1" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
if sys.argv[2] == "version":
    print(project["version"])
else:
    urls = {k.lower(): v for k, v in project.get("urls", {}).items()}
    print(next((urls[k] for k in ("source", "repository", "homepage") if k in urls), ""))
PY
}
VERSION="$(read_project version)" || die "could not read [project] version from pyproject.toml"
[[ "$VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]] || die "pyproject.toml version '$VERSION' is not X.Y.Z"
if [[ -n "${OUTBOXKIT_IMAGE:-}" ]]; then
    TAGS=("$OUTBOXKIT_IMAGE")
else
    TAGS=("localhost/outboxkit:$VERSION" "localhost/outboxkit:dev")
fi
IMAGE="${TAGS[0]}"
SOURCE_URL="${OUTBOXKIT_SOURCE_URL:-$(read_project urls)}"
if [[ -z "$SOURCE_URL" ]]; then
    # A clone's origin, as https and without user or token.
    SOURCE_URL="$(git -C "$REPO_ROOT" remote get-url origin 2>/dev/null |
        sed -E 's#^git@([^:]+):#https://\1/#; s#^ssh://([^@/]*@)?([^/:]+)(:[0-9]+)?/#https://\2/#;
               s#^(https?://)[^/@]*@#\1#; s#\.git$##')" || true
fi
[[ -n "$SOURCE_URL" ]] ||
    die "no source address for the image label: set OUTBOXKIT_SOURCE_URL (the repository's URL)"
REVISION="$(git -C "$REPO_ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"

ensure_packages buildah mmdebstrap uidmap

have_image() { buildah inspect --type image "$1" >/dev/null 2>&1; }

if have_image "$BASE_IMAGE"; then
    log "base $BASE_IMAGE: cached"
else
    log "base $BASE_IMAGE: mmdebstrap bookworm (a few minutes, log: $BUILD_DIR/base.log)"
    tarball="$BUILD_DIR/base.tar"
    mmdebstrap --variant=minbase \
        --include=python3,python3-pip,python3-venv,python-is-python3,passwd,ca-certificates \
        bookworm "$tarball" >"$BUILD_DIR/base.log" 2>&1 \
        || die "mmdebstrap failed; see $BUILD_DIR/base.log"
    ctr="$(buildah from scratch)"
    trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
    buildah add "$ctr" "$tarball" / >>"$BUILD_DIR/base.log"
    # As in the official Python images: pip may install into the system
    # interpreter (Debian marks it externally managed).
    buildah run --isolation chroot "$ctr" -- \
        sh -c 'rm -f /usr/lib/python3*/EXTERNALLY-MANAGED' >>"$BUILD_DIR/base.log" 2>&1
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        "$ctr"
    buildah commit -q "$ctr" "$BASE_IMAGE" >>"$BUILD_DIR/base.log"
    rm -f "$tarball"
    log "base $BASE_IMAGE: built"
fi

mounts=()
for f in /etc/ssl/certs/ca-certificates.crt /etc/pip.conf; do
    [[ -f "$f" ]] && mounts+=(-v "$f:$f:ro")
done

# The sources the wheel is built from, hashed: the install step's cache key
# (see the Dockerfile; buildah's layer cache does not look into its mount).
source_hash="$(cd "$REPO_ROOT" && find pyproject.toml outboxkit relay consumer schema \
    -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z |
    xargs -0 sha256sum | sha256sum | cut -c1-16)"
log "image $IMAGE: buildah bud, sources $source_hash (log: $BUILD_DIR/image.log)"
started=$(date +%s)
bud() {
    (cd "$REPO_ROOT" && buildah bud --isolation chroot --layers --format docker \
        --build-arg "PYTHON_IMAGE=$BASE_IMAGE" --build-arg "OUTBOXKIT_SOURCE=$source_hash" \
        --build-arg "OUTBOXKIT_VERSION=$VERSION" --build-arg "OUTBOXKIT_SOURCE_URL=$SOURCE_URL" \
        --build-arg "OUTBOXKIT_REVISION=$REVISION" \
        "${mounts[@]}" "$@" \
        -f deploy/docker/Dockerfile -t "$IMAGE" .) >>"$BUILD_DIR/image.log" 2>&1
}
: >"$BUILD_DIR/image.log"
if ! bud; then
    # buildah (1.28) cannot bind-mount from a stage that came whole from its
    # layer cache while a later step did not (after an image was removed, its
    # layers went with it): the mount is empty and pip finds no wheels. Once,
    # without the cache.
    grep -q "on host to bind mount into container" "$BUILD_DIR/image.log" ||
        die "buildah bud failed; see $BUILD_DIR/image.log"
    log "image $IMAGE: the cached build stage could not be mounted; building again without the layer cache"
    bud --no-cache || die "buildah bud failed; see $BUILD_DIR/image.log"
fi
id="$(buildah inspect --type image --format '{{.FromImageID}}' "$IMAGE")"
for tag in "${TAGS[@]:1}"; do
    buildah tag "$id" "$tag"
done
size="$(buildah images --format '{{.Size}}' "$IMAGE" | sed -n 1p)"
log "image ${TAGS[*]}: $id ($size, version $VERSION) in $(($(date +%s) - started))s"
echo "$id"
