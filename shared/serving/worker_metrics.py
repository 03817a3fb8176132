"""The Prometheus series of one prefill or decode instance."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from shared.engine.snapshot import EngineSnapshot
from shared.engine.swap import SwapStats
from shared.serving.metrics import (
    MODEL_LABEL,
    VLLM_REQUEST_LATENCY_BUCKETS,
    latency_histogram,
    vllm_gauge,
    vllm_histogram,
)


class WorkerMetrics:
    """One instance's series: Baton's, and vLLM's for its engine (the ``vllm:*`` ones,
    labelled with the model's name once it is loaded; see :mod:`shared.serving.metrics`)."""

    def __init__(self, role: str):
        self.role = role
        self.model_name = ""  # set by :meth:`bind` once the engine has loaded
        r = self.registry = CollectorRegistry()
        self.requests = Gauge(
            "baton_requests_in_flight", f"Requests in this {role} instance", registry=r
        )
        self.kv_usage = Gauge("baton_kv_pool_usage", "Share of KV pool blocks in use", registry=r)
        self.step_s = latency_histogram(
            r, "baton_engine_step_seconds", "Duration of one engine step"
        )
        self.step_tokens = Counter(
            "baton_engine_step_tokens", "Tokens computed by engine steps", registry=r
        )
        self.swaps = Counter(
            "baton_kv_swaps",
            "Preempted requests whose KV went out to host memory or stayed in the KV store "
            "(tier, when the host space was full), and came back in",
            ["direction", "tier"],
            registry=r,
        )
        self.swap_bytes = Counter(
            "baton_kv_swap_bytes", "KV bytes swapped, by direction", ["direction"], registry=r
        )
        self.spilled_tokens = Counter(
            "baton_kv_spill_resumed_tokens",
            "Generated tokens of preempted requests whose KV was loaded back from the KV "
            "store (spilled) rather than recomputed",
            registry=r,
        )
        self.recompute_preemptions = Counter(
            "baton_preemption_recomputes",
            "Preempted requests that recompute instead of swapping: recomputing measured "
            "cheaper (cost), or the host swap space was full and nothing spilled to the "
            "KV store (no_room)",
            ["reason"],
            registry=r,
        )
        self._swap_seen = SwapStats()
        self._preemptions_seen = 0
        self.preemptions = Counter(
            "baton_preemptions",
            "Running requests preempted for KV blocks (swapped or recomputed)",
            registry=r,
        )
        self.threads = Gauge(
            "baton_engine_threads", "Threads the last engine step ran on", registry=r
        )
        self.thread_seconds = Counter(
            "baton_engine_thread_seconds",
            "Engine step time by the number of threads it ran on",
            ["threads"],
            registry=r,
        )
        self._thread_seconds_seen: dict[int, float] = {}
        self.info = Gauge(
            "baton_instance_info",
            "This instance (always 1): join on it to split series by role",
            ["role", "instance_id", MODEL_LABEL],
            registry=r,
        )
        self.vllm_running = vllm_gauge(
            r, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.vllm_waiting = vllm_gauge(
            r,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed (queued for KV slots or compute, "
            "loading KV, or waiting for their first token).",
        )
        self.vllm_kv_usage = vllm_gauge(
            r, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.vllm_queue_time = vllm_histogram(
            r,
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )
        self.vllm_prefill_time = vllm_histogram(
            r,
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )

    def bind(self, model_name: str, instance_id: str) -> None:
        """The engine has loaded ``model_name``: vLLM's series carry it (at 0 from now)."""
        self.model_name = model_name
        self.info.labels(self.role, instance_id, model_name).set(1)
        for family in (self.vllm_running, self.vllm_waiting, self.vllm_kv_usage):
            family.labels(model_name)
        self.vllm_queue_time.labels(model_name)
        self.vllm_prefill_time.labels(model_name)

    def observe_step(self, seconds: float, tokens: int) -> None:
        self.step_s.observe(seconds)
        self.step_tokens.inc(tokens)

    def observe_thread_seconds(self, totals: dict[int, float]) -> None:
        """The engine loop's running totals (step seconds by thread count) into the counter."""
        for threads, total in list(totals.items()):
            seen = self._thread_seconds_seen.get(threads, 0.0)
            if total > seen:
                self.thread_seconds.labels(str(threads)).inc(total - seen)
                self._thread_seconds_seen[threads] = total

    def observe_engine(self, snap: EngineSnapshot, in_flight: int) -> None:
        """The gauges, from the engine's latest snapshot."""
        self.requests.set(in_flight)
        self.kv_usage.set(snap.usage)
        m = self.model_name
        self.vllm_running.labels(m).set(snap.running)
        self.vllm_waiting.labels(m).set(snap.waiting + snap.loading + snap.parked)
        self.vllm_kv_usage.labels(m).set(snap.usage)
        self._observe_swaps(snap.swap)
        self.preemptions.inc(snap.preemptions - self._preemptions_seen)
        self._preemptions_seen = snap.preemptions

    def _observe_swaps(self, now: SwapStats) -> None:
        seen, self._swap_seen = self._swap_seen, now
        self.swaps.labels("out", "host").inc(now.swaps_out - seen.swaps_out)
        self.swaps.labels("in", "host").inc(now.swaps_in - seen.swaps_in)
        self.swaps.labels("out", "store").inc(now.spills_out - seen.spills_out)
        self.swaps.labels("in", "store").inc(now.spills_in - seen.spills_in)
        self.spilled_tokens.inc(now.spilled_tokens_in - seen.spilled_tokens_in)
        self.swap_bytes.labels("out").inc(now.bytes_out - seen.bytes_out)
        self.swap_bytes.labels("in").inc(now.bytes_in - seen.bytes_in)
        self.recompute_preemptions.labels("cost").inc(now.recomputes - seen.recomputes)
        self.recompute_preemptions.labels("no_room").inc(
            now.recomputes_no_room - seen.recomputes_no_room
        )

    def observe_prompt_phases(self, queue_s: float, prefill_s: float) -> None:
        """A prompt computed here: arrival to its first step, first step to first token."""
        self.vllm_queue_time.labels(self.model_name).observe(queue_s)
        self.vllm_prefill_time.labels(self.model_name).observe(prefill_s)

    def render(self, refresh: Callable[[], None] | None = None) -> bytes:
        if refresh is not None:
            refresh()
        return generate_latest(self.registry)
