#!/usr/bin/env bash
# Build the Baton image (baton:latest), the Redis image (baton-redis:latest) and the
# balancer image (baton-balancer:latest) with BuildKit, on any machine:
#   bash scripts/docker-build.sh
# Environment:
#   BATON_BASE_IMAGE   base of the Baton image; default python:3.11-slim where it can be
#                      pulled, else debian:bookworm built locally (scripts/docker-base.sh)
#   BATON_TORCH        torch requirement (default torch==2.13.0, the CPU build)
#   BATON_BUILD_CA     extra CA bundle (PEM) for pip and apt in the build; default the
#                      first of $PIP_CERT, $REQUESTS_CA_BUNDLE, $SSL_CERT_FILE that exists
#   PIP_INDEX_URL      package index for the build (default PyPI)
#   DOCKER             the docker client (default: one that can build with BuildKit)
# A torch wheel the host's pip finds without an index (its find-links) is handed to the
# build through docker/wheels/, for machines where download.pytorch.org is unreachable.
set -euo pipefail
cd "$(dirname "$0")/.."

buildkit_client() {
  # Docker >= 23 builds with BuildKit only through the buildx plugin; older clients
  # (Debian's docker.io 20.10) have BuildKit built in.
  local c
  for c in $(which -a docker 2>/dev/null | awk '!seen[$0]++'); do
    if "$c" buildx version >/dev/null 2>&1; then echo "$c"; return; fi
    local major
    major=$("$c" version -f '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)
    if [ -n "$major" ] && [ "$major" -lt 23 ] 2>/dev/null; then echo "$c"; return; fi
  done
  return 1
}
docker=${DOCKER:-$(buildkit_client)} || {
  echo "docker-build: no docker client that can build with BuildKit (install buildx)" >&2
  exit 2
}
export DOCKER_BUILDKIT=1

base=${BATON_BASE_IMAGE:-}
redis_base=debian:bookworm-slim
if [ -z "$base" ]; then
  if "$docker" image inspect python:3.11-slim >/dev/null 2>&1 \
    || "$docker" pull -q python:3.11-slim >/dev/null 2>&1; then
    base=python:3.11-slim
  else
    echo "docker-build: python:3.11-slim cannot be pulled; building a local Debian base"
    DOCKER="$docker" bash scripts/docker-base.sh debian:bookworm
    base=debian:bookworm
    redis_base=debian:bookworm
  fi
fi

args=(--build-arg "BASE_IMAGE=$base" --build-arg "BATON_TORCH=${BATON_TORCH:-torch==2.13.0}")
[ -z "${PIP_INDEX_URL:-}" ] || args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL")
find docker/wheels -name '*.whl' -delete
py=$(command -v python3)
[ ! -x .venv/bin/python ] || py=.venv/bin/python
if "$py" -m pip download --quiet --no-index --no-deps -d docker/wheels \
  "${BATON_TORCH:-torch==2.13.0}" >/dev/null 2>&1; then
  echo "docker-build: using the local wheel $(ls docker/wheels/*.whl)"
  args+=(--build-arg "TORCH_INDEX_URL=")
fi
ca=${BATON_BUILD_CA:-}
if [ -z "$ca" ]; then
  for f in "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}"; do
    if [ -n "$f" ] && [ -s "$f" ]; then ca=$f; break; fi
  done
fi
[ -z "$ca" ] || args+=(--secret "id=ca_bundle,src=$ca")

"$docker" build "${args[@]}" -t baton:latest .
find docker/wheels -name '*.whl' -delete  # the small images' context is docker/
"$docker" build --build-arg "BASE_IMAGE=$redis_base" -t baton-redis:latest -f docker/redis.Dockerfile docker
"$docker" build --build-arg "BASE_IMAGE=$redis_base" -t baton-balancer:latest -f docker/balancer.Dockerfile docker
echo "docker-build: baton:latest $("$docker" image inspect -f '{{.Size}}' baton:latest) bytes"
