# One image for every role: the command picks the role (see docker-compose.yml).
# Needs BuildKit (`DOCKER_BUILDKIT=1 docker build`, buildx, or Compose v2).
#
# Build arguments:
#   BASE_IMAGE       python:3.11-slim, or any Debian bookworm image: without a Python
#                    in it, Debian's python3 is installed (scripts/docker-base.sh builds
#                    debian:bookworm locally for machines without registry access)
#   BATON_TORCH      the torch requirement (the CPU build by default)
#   TORCH_INDEX_URL  where that torch is found; empty: only PyPI and docker/wheels/
#   PIP_INDEX_URL    a package index other than PyPI (a mirror or corporate proxy)
#   PREPARE          1: build the native kernels and pack the weights for the build
#                    machine's CPU at build time (engines on the same CPU then start
#                    without either); 0: each container does it on its first start
# Build secret (optional):
#   ca_bundle        extra CA certificates (PEM) for pip and apt behind a TLS-inspecting
#                    proxy: --secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG BATON_TORCH=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PREPARE=1

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BATON_CACHE_DIR=/opt/baton/cache \
    PATH=/opt/baton/venv/bin:$PATH

# A C compiler builds the native kernels for the host CPU; tini is PID 1 (signals reach
# the service, zombies are reaped). Debian's python3 only where the base has none.
RUN --mount=type=secret,id=ca_bundle \
    set -eu; \
    if [ -s /run/secrets/ca_bundle ]; then \
      cp /run/secrets/ca_bundle /usr/local/share/baton-build-ca.pem; \
      printf 'Acquire::https::CaInfo "/usr/local/share/baton-build-ca.pem";\n' > /etc/apt/apt.conf.d/99baton-ca; \
    fi; \
    py=""; command -v python3 >/dev/null || py="python3 python3-venv"; \
    apt-get update; \
    apt-get install -y --no-install-recommends gcc libc6-dev tini ca-certificates $py; \
    rm -rf /var/lib/apt/lists/* /etc/apt/apt.conf.d/99baton-ca /usr/local/share/baton-build-ca.pem; \
    python3 -m venv /opt/baton/venv

WORKDIR /opt/baton/src
# pip trusts the extra CA on top of its own bundle, for this step only; the local
# wheels are bound in for this step, never copied into a layer.
RUN --mount=type=secret,id=ca_bundle \
    --mount=type=bind,source=docker/wheels,target=/opt/baton/wheels \
    set -eu; \
    if [ -s /run/secrets/ca_bundle ]; then \
      cat "$(python -c 'import pip._vendor.certifi as c; print(c.where())')" /run/secrets/ca_bundle > /tmp/ca.pem; \
      export PIP_CERT=/tmp/ca.pem; \
    fi; \
    extra=""; [ -z "$TORCH_INDEX_URL" ] || extra="--extra-index-url $TORCH_INDEX_URL"; \
    pip install --find-links /opt/baton/wheels --index-url "$PIP_INDEX_URL" $extra "$BATON_TORCH"; \
    rm -f /tmp/ca.pem

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
# The model is pulled at build, so containers start without network.
RUN --mount=type=secret,id=ca_bundle \
    set -eu; \
    if [ -s /run/secrets/ca_bundle ]; then \
      cat "$(python -c 'import pip._vendor.certifi as c; print(c.where())')" /run/secrets/ca_bundle > /tmp/ca.pem; \
      export PIP_CERT=/tmp/ca.pem; \
    fi; \
    pip install --index-url "$PIP_INDEX_URL" .; \
    if [ "$PREPARE" = 1 ]; then baton model pull --prepare; else baton model pull; fi; \
    rm -f /tmp/ca.pem

EXPOSE 8000 8100 8200 8300 8301
ENTRYPOINT ["tini", "--"]
CMD ["baton", "up"]
