#!/usr/bin/env bash
# System packages the whole test suite uses beyond Python: a Docker engine and
# docker-compose (tests/test_compose.py runs docker-compose.yml for real), debootstrap
# (a local Debian base image where no registry is reachable) and Chromium (the status
# page test). Installs with apt where it can (root, Debian/Ubuntu); elsewhere it says
# what is missing and the tests that need it skip with the reason.
set -euo pipefail
want=()
command -v dockerd >/dev/null || want+=(docker.io)
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || want+=(docker-compose)
command -v debootstrap >/dev/null || want+=(debootstrap)
command -v chromium >/dev/null || want+=(chromium)
if [ ${#want[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-system: not installing ${want[*]} (needs root and apt-get); the tests that use them will skip" >&2
  exit 0
fi
echo "install-system: apt-get install ${want[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${want[@]}" tini >/dev/null
