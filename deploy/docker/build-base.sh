#!/usr/bin/env bash
# Build a local Debian base image without any registry (air-gapped): debootstrap + docker import.
# Usage: deploy/docker/build-base.sh [IMAGE]   (default specroll-base:bookworm)
# The debootstrap tarball is cached in $SPECROLL_BASE_CACHE (default ~/.cache/specroll-ci) and reused.
# The host's CA bundle goes into the image so pip trusts the same (possibly intercepting) proxies as the host.
set -euo pipefail
image="${1:-specroll-base:bookworm}"
cache="${SPECROLL_BASE_CACHE:-$HOME/.cache/specroll-ci}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
tarball="$cache/bookworm-minbase-python.tar"
ca="${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

if docker image inspect "$image" >/dev/null 2>&1; then
    echo "build-base: $image already present"
    exit 0
fi
mkdir -p "$cache"
if [[ ! -s "$tarball" ]]; then
    rootfs=$(mktemp -d "$cache/rootfs.XXXXXX")
    trap 'rm -rf "$rootfs"' EXIT
    echo "build-base: debootstrap bookworm into $rootfs"
    debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates bookworm "$rootfs" "$mirror"
    if [[ -r "$ca" ]]; then
        cp "$ca" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
fi
docker import "$tarball" "$image"
echo "build-base: imported $image"
