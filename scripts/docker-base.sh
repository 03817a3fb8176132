#!/usr/bin/env bash
# Build a local Debian base image for machines that cannot pull from a registry.
#   bash scripts/docker-base.sh [TAG] [MIRROR]
# TAG defaults to debian:bookworm; MIRROR to the first Debian mirror in the host's apt
# sources (http://deb.debian.org/debian where none is found). Needs debootstrap and a
# running Docker engine; takes about a minute. Idempotent: an existing TAG is kept.
set -euo pipefail
tag=${1:-debian:bookworm}
mirror=${2:-}
docker=${DOCKER:-docker}
if "$docker" image inspect "$tag" >/dev/null 2>&1; then
  echo "docker-base: $tag already exists"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "docker-base: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 2; }
if [ -z "$mirror" ]; then
  mirror=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d 2>/dev/null \
    | grep -oE 'https?://[^ ]+' | head -1 || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi
root=$(mktemp -d /var/tmp/baton-debootstrap.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "docker-base: debootstrap bookworm from $mirror"
debootstrap --variant=minbase bookworm "$root" "$mirror" >/dev/null
# apt inside the image uses the same mirror; no caches or logs in the layer.
echo "deb $mirror bookworm main" > "$root/etc/apt/sources.list"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*
tar -C "$root" -c . | "$docker" import - "$tag" >/dev/null
echo "docker-base: built $tag ($("$docker" image inspect -f '{{.Size}}' "$tag") bytes)"
