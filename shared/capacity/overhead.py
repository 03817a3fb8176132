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

Around each group of requests it also reads the CPU seconds that the processes
beside the engines used (the gateway, the KV store and Redis, from ``/proc``;
this process, the load generator; and the prefill and decode processes' threads
other than the engine's, which move KV and stream tokens) and fits them, by
least squares over the groups, as seconds per request, per prompt token and per
streamed token (:class:`~shared.capacity.profile.SideCpu`). In the batches those
three grow together (``b`` requests, ``b`` prompts, ``b`` equal streams), so one
more batch of longer streams is metered for the CPU alone: without it the cost
per streamed token is what is left once the other two are fitted on the prompts
sent alone, and their noise, divided by the few tokens of a stream, put the
store's cost anywhere from 155 to 649 us per token in six profiles of one host
(413-573 us in three with this batch). Under load those
threads take cores from the engines, which the latency figures above, taken one
request at a time, do not show.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from shared.bench import workload as wl
from shared.bench.metrics import RequestResult
from shared.bench.runner import Target, discover_model, run_open_loop
from shared.capacity.profile import Profile, ServiceOverhead, SideCpu
from shared.procs import cpu_seconds

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
class SideUse:
    """One group of requests and the CPU seconds used beside the engines meanwhile."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    cluster_s: float
    client_s: float
    workers_s: float = 0.0  # the prefill and decode processes beyond their engine threads


def fit_side(groups: Sequence[SideUse], cpu_of: Callable[[SideUse], float]) -> SideCpu:
    """Seconds per request, prompt token and output token (least squares, none < 0)."""
    if not groups:
        return SideCpu()
    a = np.array([[g.requests, g.prompt_tokens, g.output_tokens] for g in groups], float)
    y = np.array([cpu_of(g) for g in groups], float)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    request_s, prompt_token_s, output_token_s = (max(0.0, float(c)) for c in coef)
    return SideCpu(request_s, prompt_token_s, output_token_s)


class _SideMeter:
    """CPU seconds used by ``pids`` (the gateway, the store, Redis), by ``workers`` (the
    prefill and decode processes) less their engine threads, and by this process (the
    load generator), since the last reading."""

    def __init__(self, pids: Sequence[int], workers: Sequence[int], engine_thread: str):
        self.pids = pids
        self.workers = workers
        self.engine_thread = engine_thread
        self._last = self._read()

    def restart(self) -> None:
        """Count from now (what happened since the last reading is not a group)."""
        self._last = self._read()

    def _read(self) -> tuple[float, float, float]:
        return (
            sum(cpu_seconds(p) for p in self.pids),
            time.process_time(),
            sum(cpu_seconds(p, except_thread=self.engine_thread) for p in self.workers),
        )

    def group(self, requests: int, prompt_tokens: int, output_tokens: int) -> SideUse:
        now = self._read()
        cluster, client, workers = (b - a for a, b in zip(self._last, now, strict=True))
        self._last = now
        return SideUse(requests, prompt_tokens, output_tokens, cluster, client, workers)


@dataclass(frozen=True)
class Points:
    """What to send: prompts alone (their lengths, ``alone`` times each), then batches
    of streams. ``/proc`` counts CPU in ticks (10 ms), summed over a handful of
    processes: groups must be large enough for that to round away."""

    prompt_tokens: tuple[int, ...] = (256, 1024)
    batches: tuple[int, ...] = (1, 8, 16)
    stream_prompt: int = 128
    stream_tokens: int = 64
    alone: int = 6
    # a batch of longer streams (CPU only; 0 tokens: none)
    long_streams: int = 8
    long_stream_tokens: int = 320


QUICK = Points(prompt_tokens=(512,), batches=(1, 8), alone=3, long_stream_tokens=192)


def measure_overhead(
    profile: Profile,
    *,
    model: str | None = None,
    dtype: str | None = None,
    points: Points = Points(),
    progress: Progress = lambda _: None,
) -> ServiceOverhead:
    from shared.engine.engine_loop import ENGINE_THREAD
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
            meter = _SideMeter(
                cluster.pids({"gateway", "kvstore", "redis"}),
                cluster.pids({"prefill", "decode"}),
                ENGINE_THREAD,
            )
            groups = []
            ttfts = {}
            # warm-up, not counted: first requests open connections and take code paths
            # (and the store's first blocks) that no later request pays for again
            warm = [
                wl.RequestSpec(wl.synthetic_prompt(points.stream_prompt, rng), 8) for _ in range(4)
            ]
            asyncio.run(run_open_loop(target, warm, _quiet))
            for n in points.prompt_tokens:
                times = []
                meter.restart()
                for _ in range(points.alone):
                    spec = wl.RequestSpec(wl.synthetic_prompt(n, rng), 2)
                    results, _ = asyncio.run(run_open_loop(target, [spec], _quiet))
                    times.append(_timed(results)[0][0])
                groups.append(meter.group(points.alone, points.alone * n, points.alone * 2))
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
                meter.restart()
                results, _ = asyncio.run(run_open_loop(target, specs, _quiet))
                groups.append(meter.group(b, b * points.stream_prompt, b * points.stream_tokens))
                tpot = statistics.median(t for _, t in _timed(results))
                context = b * (points.stream_prompt + points.stream_tokens // 2)
                tpots[b] = (context, tpot)
                progress(f"serving overhead: {b} streams, TPOT {tpot * 1e3:.1f}ms")
            if points.long_stream_tokens:
                b, n = points.long_streams, points.long_stream_tokens
                specs = [
                    wl.RequestSpec(wl.synthetic_prompt(points.stream_prompt, rng), n)
                    for _ in range(b)
                ]
                meter.restart()
                _timed(asyncio.run(run_open_loop(target, specs, _quiet))[0])
                groups.append(meter.group(b, b * points.stream_prompt, b * n))
                progress(f"serving overhead: {b} streams of {n} tokens (CPU only)")
        finally:
            cluster.stop()
    return replace(
        fit(profile, ttfts, tpots),
        cluster=fit_side(groups, lambda g: g.cluster_s),
        client=fit_side(groups, lambda g: g.client_s),
        workers=fit_side(groups, lambda g: g.workers_s),
    )


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
