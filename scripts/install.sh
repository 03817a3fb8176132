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
