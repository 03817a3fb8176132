"""The device check of the CUDA path: one run on a machine with one NVIDIA GPU, one JSON
file of results (``scripts/gpu-check.sh`` installs what the machine lacks and runs it).

Sections, each guarded (a failure is recorded with its traceback and the rest go on),
the JSON rewritten after each:

- ``unit_tests``: the CUDA tests (kernels, staged pool copies, the engine), which
  skip on machines without a GPU;
- ``transformers`` (a): our engine on CUDA against transformers on CUDA, greedy ids;
- ``invariance``: whether outputs change with batch composition or with prefill vs
  decode, with the kernels an engine picks on CUDA and with torch's;
- ``graphs``: a decode step's forward eager against a CUDA graph replay;
- ``serving``: (b) a 1 prefill + 1 decode cluster on the GPU against the in-process
  engine, requests one at a time; (d) TTFT, TPOT and throughput at 1, 8 and 32 in
  flight, and KV save/load bandwidth GPU -> store -> GPU against host<->device copies;
- ``failover`` (c): decode SIGKILLed mid-stream, resumed token-exact.

    python -m benchmarks.gpu_check --out gpu-check.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_cluster_check import failover_check, guarded, reference_engine, serving_checks
from benchmarks.gpu_model_check import graph_check, invariance_check, transformers_check
from shared.config import BatonSettings
from shared.engine.engine import Engine
from shared.hardware import cpu_model

CUDA_TESTS = (
    "tests/shared/kernels/test_triton_kernels.py",
    "tests/shared/kvstore/test_pool_copies.py",
    "tests/shared/engine/test_cuda_engine.py",
    "tests/services/kvstore/test_device_buffers.py",
    "tests/services/kvstore/test_arena_cuda.py",
)


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"


def device_info() -> dict[str, Any]:
    gpu: dict[str, Any] = {"gpu": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "gpu": props.name,
            "capability": f"{props.major}.{props.minor}",
            "gpu_memory_gib": round(props.total_memory / (1 << 30), 1),
        }
    cpu = cpu_model()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {
        **gpu,
        "driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        # the device gets the working tree without its history: the caller names it
        "commit": os.environ.get("BATON_CHECK_COMMIT")
        or _run(["git", "rev-parse", "--short", "HEAD"]),
    }


def unit_tests() -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return {"returncode": proc.returncode, "tail": lines[-40:], "ok": proc.returncode == 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    ap.add_argument("--logs", type=Path, default=None, help="keep the services' logs here")
    ap.add_argument("--only", nargs="*", default=None, help="run these sections (default: all)")
    args = ap.parse_args()
    cache_dir = BatonSettings().cache_dir
    report: dict[str, Any] = {"device": device_info(), "sections": {}}
    ref: list[Engine] = []

    def reference() -> Engine:
        if not ref:
            ref.append(reference_engine(cache_dir))
        return ref[0]

    # what the issue asks first, so that a run cut short still answers it
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("transformers", lambda: transformers_check(cache_dir)),
        ("serving", lambda: serving_checks(cache_dir, args.logs, reference())),
        ("failover", lambda: failover_check(cache_dir, args.logs, reference())),
        ("invariance", lambda: invariance_check(cache_dir)),
        ("graphs", lambda: graph_check(cache_dir)),
        ("unit_tests", unit_tests),
    ]
    for name, run in sections:
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        print(f"gpu-check: {name} ...", flush=True)
        result = guarded(run)
        result["seconds"] = round(time.perf_counter() - t0, 1)
        report["sections"][name] = result
        print(f"gpu-check: {name}: ok={result.get('ok')} in {result['seconds']}s", flush=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    report["summary"] = summary(report["sections"])
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report["summary"], indent=1))


def summary(s: dict[str, Any]) -> dict[str, Any]:
    def ok(*path: str) -> bool | None:
        node: Any = s
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return bool(node)

    return {
        "unit_tests": ok("unit_tests", "ok"),
        "a_engine_vs_transformers_fp32": ok("transformers", "ok"),
        "invariant_triton": ok("invariance", "ok"),
        "b_cluster_exact": ok("serving", "exact", "ok"),
        "c_failover_exact": ok("failover", "ok"),
        "d_bench": ok("serving", "bench", "ok"),
        "kv_bandwidth_target": ok("serving", "kv_bandwidth", "target_met"),
    }


if __name__ == "__main__":
    main()
