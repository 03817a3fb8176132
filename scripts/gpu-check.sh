#!/usr/bin/env bash
# The device check of the CUDA path, on a machine with one NVIDIA GPU, PyTorch and Triton
# and no network (benchmarks/gpu_check.py; docs/benchmarks.md, "GPU", says what it runs).
#
#   scripts/gpu-check.sh [OUT_DIR]        results: OUT_DIR/gpu-check.json (default $OUT)
#
# What the machine lacks travels in BATON_GPU_CARRY (default .gpu, git-ignored):
#   whl/*.whl       Python packages it lacks (installed with --no-index into /tmp)
#   redis-server    a redis-server binary (BATON_REDIS_SERVER)
#   model.gguf      the default model (SmolLM2-135M-Instruct.Q4_1.gguf), or split into
#   part-*          parts (`split -b 50000000`), which may come in several calls: each
#                   call adds its parts to BATON_GPU_STASH (default /root/baton-stash)
# Until every part is there, only the checks that need no model run, and it exits 3.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu-check-out}}
CARRY=${BATON_GPU_CARRY:-.gpu}
STASH=${BATON_GPU_STASH:-/root/baton-stash}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR" "$STASH"
export PYTHONUNBUFFERED=1

SITE=/tmp/baton-site
if compgen -G "$CARRY/whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$CARRY"/whl/*.whl
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -x "$CARRY/redis-server" ]; then
  export BATON_REDIS_SERVER="$PWD/$CARRY/redis-server"
fi

export BATON_CACHE_DIR=${BATON_CACHE_DIR:-/root/.cache/baton}
MODEL="$BATON_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if compgen -G "$CARRY/part-*" >/dev/null; then
  cp "$CARRY"/part-* "$STASH"/
fi
if [ ! -f "$MODEL" ]; then
  mkdir -p "$(dirname "$MODEL")"
  if [ -f "$CARRY/model.gguf" ]; then
    cp "$CARRY/model.gguf" "$MODEL.part"
  elif compgen -G "$STASH/part-*" >/dev/null; then
    cat "$STASH"/part-* >"$MODEL.part"
  else
    : >"$MODEL.part"
  fi
  # the registry's own check: the file is the default model, byte for byte
  if "$PY" -c "
import sys
from shared.model.registry import DEFAULT_MODEL, sha256_file
sys.exit(0 if sha256_file(sys.argv[1]) == DEFAULT_MODEL.sha256 else 1)" "$MODEL.part"; then
    mv "$MODEL.part" "$MODEL"
  else
    rm -f "$MODEL.part"
    echo "gpu-check: the model is not complete yet (parts here: $(ls "$STASH" | tr '\n' ' '))"
    echo "gpu-check: running the checks that need no model"
    set +e
    "$PY" -c "import services.gateway.app, services.prefill.app, services.decode.app, \
services.kvstore.app, shared.transport.tcp; print('gpu-check: every service imports')"
    "$PY" -m pytest -q -p no:cacheprovider tests/shared/kernels/test_triton_kernels.py \
      tests/shared/kvstore/test_pool_copies.py tests/shared/kvstore/test_device_buffers.py \
      tests/services/kvstore/test_device_buffers.py tests/services/kvstore/test_arena_cuda.py \
      2>&1 | tee "$OUT_DIR/unit-tests.log"
    exit 3
  fi
fi

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
# the services' logs come back as one archive (the device returns a few files only)
LOGS=/tmp/baton-gpu-logs
trap 'tar -czf "$OUT_DIR/service-logs.tar.gz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null' EXIT
"$PY" -m benchmarks.gpu_check --out "$OUT_DIR/gpu-check.json" --logs "$LOGS"
