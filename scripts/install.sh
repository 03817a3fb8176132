#!/usr/bin/env bash
# Install Baton and everything it needs into ./.venv (idempotent).
#   BATON_EXTRAS=test   also install the test tools (default: none)
#   BATON_TORCH=...     torch requirement (default torch==2.13.0, the CPU wheel;
#                       set e.g. BATON_TORCH=torch to take your platform's CUDA build)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "${BATON_TORCH:-torch==2.13.0}"
spec="."
if [ -n "${BATON_EXTRAS:-}" ]; then
  spec=".[${BATON_EXTRAS}]"
fi
.venv/bin/python -m pip install --quiet -e "$spec"
# the balancer in front of several gateways (baton up --gateways N): Debian's HAProxy
if ! command -v haproxy >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y --no-install-recommends haproxy >/dev/null \
      || { apt-get update -qq && apt-get install -y --no-install-recommends haproxy >/dev/null; } \
      || echo "install: haproxy could not be installed; baton up --gateways N needs it" >&2
  else
    echo "install: haproxy not found (apt-get install haproxy); baton up --gateways N needs it" >&2
  fi
fi
