"""The cluster on a CUDA device (the serving half of ``benchmarks/gpu_check.py``): Redis,
a KV store node, prefill and decode on the GPU, the gateway; the TCP data plane.

- ``exact`` (1 prefill + 1 decode): requests one at a time, greedy and seeded; token
  ids against the same engine in this process on the same GPU;
- ``bench`` (same cluster): TTFT, TPOT and throughput at 1, 8 and 32 in flight
  (512 prompt tokens, 128 generated, distinct prompts), after a warm-up that compiles
  the kernels;
- ``kv_bandwidth`` (same cluster's store): see :mod:`benchmarks.gpu_kv_bandwidth`;
- ``failover`` (1 prefill + 2 decode, a supervisor restarting what dies): decode
  instances SIGKILLed mid-stream; every stream against the failure-free tokens.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_cluster import bench_cluster
from benchmarks.gpu_kv_bandwidth import kv_bandwidth
from services.prefill.prefiller import PREFILL_CHUNK_TOKENS
from shared.bench import chaos
from shared.bench.chaos import ChaosRequest, StreamResult
from shared.bench.metrics import summarize
from shared.bench.runner import Target, run_open_loop
from shared.bench.workload import synthetic
from shared.config import CacheConfig, EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.model.loader import load_model

MODEL = "SmolLM2-135M-Instruct"
# another device only to rehearse the check where there is no GPU
DEVICE = os.environ.get("BATON_CHECK_DEVICE", "cuda")
GPU_ENV = {"BATON_DEVICE": DEVICE}
CLUSTER = {"transport": "tcp", "dtype": "bfloat16", "kv_cache_gb": 2.0, "kvstore_gb": 4.0}


def reference_engine(cache_dir: Path) -> Engine:
    """The engine the cluster's workers run, in this process on the same GPU."""
    loaded = load_model(None, cache_dir=cache_dir, dtype="bfloat16", device=DEVICE, progress=False)
    config = EngineConfig(
        dtype="bfloat16",
        device=DEVICE,
        cache=CacheConfig(kv_cache_bytes=512 << 20, enable_prefix_caching=False, prefault=False),
        scheduler=SchedulerConfig(long_prefill_token_threshold=PREFILL_CHUNK_TOKENS),
    )
    return Engine(loaded, config)


async def one_at_a_time(url: str, reqs: list[ChaosRequest]) -> list[StreamResult]:
    async with httpx.AsyncClient(timeout=600) as http:
        return [await chaos.stream(http, url, MODEL, r) for r in reqs]


def exact_check(url: str, ref: Engine, seed: int = 7) -> dict[str, Any]:
    rng = random.Random(seed)
    reqs = chaos.make_requests(rng, 8, prompt_len=(40, 700), max_tokens=96)
    results = asyncio.run(one_at_a_time(url, reqs))
    want = chaos.reference(ref, reqs, batch=1)
    bad = chaos.broken(results, want)
    return {
        "requests": len(reqs),
        "greedy": sum(r.seed is None for r in reqs),
        "seeded": sum(r.seed is not None for r in reqs),
        "mismatched": bad,
        "ok": not bad,
    }


def warm_up(url: str) -> None:
    """Compile the kernels of the shapes the bench meets (a step of 1, of several)."""
    specs = synthetic(12, 512, 16, [0.0] * 12, seed=99)
    for limit in (1, 4, 12):
        asyncio.run(run_open_loop(Target(url, MODEL), specs[:limit], lambda: None, limit))


def bench(url: str, levels: tuple[int, ...] = (1, 8, 32)) -> dict[str, Any]:
    warm_up(url)
    rows = []
    for level in levels:
        n = max(8, 3 * level)
        specs = synthetic(n, 512, 128, [0.0] * n, seed=level)
        results, duration = asyncio.run(
            run_open_loop(Target(url, MODEL), specs, lambda: None, level)
        )
        s = summarize(results, duration)
        rows.append({
            "in_flight": level, "requests": n, "failed": s.failed,
            "ttft_ms_p50": s.ttft.median * 1e3, "ttft_ms_p99": s.ttft.p99 * 1e3,
            "tpot_ms_p50": s.tpot.median * 1e3, "tpot_ms_p99": s.tpot.p99 * 1e3,
            "output_tok_s": s.output_throughput, "requests_s": s.request_throughput,
        })  # fmt: skip
    return {"prompt_tokens": 512, "output_tokens": 128, "levels": rows,
            "ok": all(r["failed"] == 0 for r in rows)}  # fmt: skip


def serving_checks(cache_dir: Path, logs: Path | None, ref: Engine) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with bench_cluster(logs, "gpu", GPU_ENV, prefill=1, decode=1, **CLUSTER) as local:
        url = local.gateway_url
        for name, run in (
            ("exact", lambda: exact_check(url, ref)),
            ("bench", lambda: bench(url)),
            ("kv_bandwidth", lambda: kv_bandwidth(local)),
        ):
            out[name] = guarded(run)
    return out


def failover_check(
    cache_dir: Path, logs: Path | None, ref: Engine, rounds: int = 2, seed: int = 11
) -> dict[str, Any]:
    rng = random.Random(seed)
    per_round: list[dict[str, Any]] = []
    with bench_cluster(logs, "gpu-failover", GPU_ENV, prefill=1, decode=2, **CLUSTER) as local:
        supervised = chaos.Supervised(local, say=print)
        try:
            warm = chaos.make_requests(rng, 2, prompt_len=(100, 200), max_tokens=16)
            asyncio.run(one_at_a_time(local.gateway_url, warm))
            for _ in range(rounds):
                chaos.settle(local)
                chaos.wait_ready(local, "decode")
                reqs = chaos.make_requests(rng, 4, prompt_len=(100, 400), max_tokens=160)
                run = asyncio.run(chaos.with_fault(local, MODEL, reqs, "kill", after_tokens=48))
                bad = chaos.broken(run.results, chaos.reference(ref, reqs, batch=1))
                gaps = run.gaps()
                per_round.append({"victim": run.victim, "streams": len(reqs), "broken": bad,
                                  "worst_gap_s": max(gaps) if gaps else None})  # fmt: skip
        finally:
            supervised.close()
    gaps = [r["worst_gap_s"] for r in per_round if r["worst_gap_s"] is not None]
    return {
        "rounds": per_round,
        "broken_streams": sum(len(r["broken"]) for r in per_round),
        "worst_gap_s_median": statistics.median(gaps) if gaps else None,
        "ok": all(not r["broken"] for r in per_round),
    }


def guarded(run: Any) -> dict[str, Any]:
    import traceback

    try:
        result: dict[str, Any] = run()
        return result
    except Exception:  # one failing check must not hide the others' figures
        return {"ok": False, "error": traceback.format_exc()[-4000:]}
