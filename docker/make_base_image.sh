#!/usr/bin/env bash
# Debian 12 base image for the air-gapped build of the Flower images (docker/flwr.Dockerfile).
#
#   docker/make_base_image.sh [IMAGE]        # default IMAGE: fl-attack-local/debian:bookworm
#
# Docker Hub is not needed: the root file system comes from a Debian mirror through
# `debootstrap --variant=minbase bookworm` (with python3, python3-venv and ca-certificates, so
# that the image builds need no package manager and no network), is packed into
# $CACHE_DIR/debian-bookworm-rootfs.tar and imported with `docker import`. Each step is skipped
# when its result exists: an existing image is kept, an existing tar is imported as it is (carry
# the tar to an air-gapped host and this script only imports it). Remove the tar to rebuild.
#
# Needs root (debootstrap, a chroot) and a running Docker daemon.
#
# Environment (all optional):
#   CACHE_DIR       where the tar goes (default <repo>/.compose/base)
#   DEBIAN_MIRROR   apt mirror for debootstrap (default http://deb.debian.org/debian)
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${1:-fl-attack-local/debian:bookworm}"
CACHE_DIR="${CACHE_DIR:-$ROOT/.compose/base}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TAR="$CACHE_DIR/debian-bookworm-rootfs.tar"
PACKAGES="python3,python3-venv,ca-certificates"

log() { printf '[base-image] %s\n' "$*" >&2; }

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    log "$IMAGE exists"
    exit 0
fi

if [[ ! -f "$TAR" ]]; then
    ((EUID == 0)) || { log "debootstrap needs root: run as root (sudo) or provide $TAR"; exit 1; }
    command -v debootstrap >/dev/null || { log "debootstrap not found (apt-get install debootstrap)"; exit 1; }
    mkdir -p "$CACHE_DIR"
    rootfs="$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")"
    trap 'rm -rf "$rootfs" "$TAR.partial"' EXIT
    log "debootstrap --variant=minbase --include=$PACKAGES bookworm ($DEBIAN_MIRROR)"
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$rootfs" "$DEBIAN_MIRROR" \
        >"$CACHE_DIR/debootstrap.log" 2>&1 \
        || { tail -n 20 "$CACHE_DIR/debootstrap.log" >&2; log "debootstrap failed"; exit 1; }
    # package caches and indexes are not needed in the image (nothing is installed with apt later)
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
    tar --numeric-owner -C "$rootfs" -cf "$TAR.partial" .
    mv "$TAR.partial" "$TAR"
    log "root file system: $TAR ($(du -h "$TAR" | cut -f1))"
fi

log "docker import $TAR $IMAGE"
docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase --include=$PACKAGES bookworm" \
    "$TAR" "$IMAGE" >/dev/null
