"""What serving costs beyond the engine, measured on a running local cluster.

The profile times the engine in one process. A deployment also streams every token
(decode instance -> gateway -> client), writes KV to the store, and runs the
event loops, the gateway and the store on the same cores, which the engine's
step times do not show. :func:`measure_overhead` starts ``1P:1D`` (one thread
each, as the planner's candidates run), then

- sends prompts one at a time: TTFT minus the profile's prefill time for the
  prompt is ``request_s``, charged once per prompt;
- runs batches of streams (all started together, their prompts short): TPOT
  minus the profile's decode step for that batch and context, fitted over the
  batch sizes as ``step_s + token_s * batch``, is charged on every decode step.

The simulator adds these to the steps it times from the profile.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.bench import workload as wl
from shared.bench.metrics import RequestResult
from shared.bench.runner import Target, discover_model, run_open_loop
from shared.capacity.profile import Profile, ServiceOverhead

Progress = Callable[[str], None]


def fit(
    profile: Profile, ttfts: dict[int, float], tpots: dict[int, tuple[int, float]]
) -> ServiceOverhead:
    """``ttfts``: prompt tokens -> median TTFT alone; ``tpots``: batch -> (context summed
    over the batch at mid-stream, median TPOT)."""
    request = statistics.median(
        max(0.0, ttft - profile.prefill_seconds(n, 1)) for n, ttft in ttfts.items()
    )
    batches = sorted(tpots)
    extra = [tpots[b][1] - profile.decode_seconds(b, tpots[b][0], 1) for b in batches]
    if len(batches) == 1:
        return ServiceOverhead(request, max(0.0, extra[0]), 0.0)
    slope, intercept = np.polyfit(np.array(batches, float), np.array(extra, float), 1)
    return ServiceOverhead(request, float(intercept), max(0.0, float(slope)))


@dataclass(frozen=True)
class Points:
    """What to send: prompts alone (their lengths), then batches of streams."""

    prompt_tokens: tuple[int, ...] = (256, 1024)
    batches: tuple[int, ...] = (1, 8, 16)
    stream_prompt: int = 128
    stream_tokens: int = 64


QUICK = Points(prompt_tokens=(512,), batches=(1, 8))


def measure_overhead(
    profile: Profile,
    *,
    model: str | None = None,
    dtype: str | None = None,
    points: Points = Points(),
    progress: Progress = lambda _: None,
) -> ServiceOverhead:
    from shared.launcher import LocalCluster, Topology
    from shared.procs import PortPicker

    def topology(redis_url: str) -> Topology:
        picker = PortPicker()
        return Topology(
            redis_url=redis_url,
            prefill=1,
            decode=1,
            gateway_port=picker(),
            ports=picker,
            transport=profile.notes.get("transport", "tcp"),
            model=model,
            dtype=dtype,
            threads=1,
        )

    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="baton-profile-") as logs:
        progress("serving overhead: starting 1P:1D")
        cluster = LocalCluster(topology, log_dir=Path(logs)).start()
        try:
            target = Target(cluster.gateway_url, asyncio.run(_model(cluster.gateway_url)))
            ttfts = {}
            for n in points.prompt_tokens:
                times = []
                for _ in range(3):
                    spec = wl.RequestSpec(wl.synthetic_prompt(n, rng), 2)
                    results, _ = asyncio.run(run_open_loop(target, [spec], _quiet))
                    times.append(_timed(results)[0][0])
                ttfts[n] = statistics.median(times)
                progress(f"serving overhead: {n}-token prompt alone, TTFT {ttfts[n]:.3f}s")
            tpots = {}
            for b in points.batches:
                specs = [
                    wl.RequestSpec(
                        wl.synthetic_prompt(points.stream_prompt, rng), points.stream_tokens
                    )
                    for _ in range(b)
                ]
                results, _ = asyncio.run(run_open_loop(target, specs, _quiet))
                tpot = statistics.median(t for _, t in _timed(results))
                context = b * (points.stream_prompt + points.stream_tokens // 2)
                tpots[b] = (context, tpot)
                progress(f"serving overhead: {b} streams, TPOT {tpot * 1e3:.1f}ms")
        finally:
            cluster.stop()
    return fit(profile, ttfts, tpots)


def _timed(results: Sequence[RequestResult]) -> list[tuple[float, float]]:
    """(TTFT, TPOT) of every result; raises if any request failed."""
    out = []
    for r in results:
        ttft, tpot = r.ttft, r.tpot
        if ttft is None or tpot is None:
            raise RuntimeError(f"a request failed while measuring: {r.error}")
        out.append((ttft, tpot))
    return out


async def _model(url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        return await discover_model(http, url)


def _quiet() -> None:
    return None
