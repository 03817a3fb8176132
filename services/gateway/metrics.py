"""The gateway's Prometheus metrics (vLLM's serving definitions: TTFT, TPOT, ITL, E2E)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from shared.serving.metrics import latency_histogram


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = latency_histogram(r, "baton_ttft_seconds", "Request arrival to first token")
        self.tpot = latency_histogram(r, "baton_tpot_seconds", "(E2E - TTFT) / (output tokens - 1)")
        self.itl = latency_histogram(r, "baton_itl_seconds", "Gap between consecutive tokens")
        self.e2e = latency_histogram(r, "baton_e2e_seconds", "Request arrival to last token")
        self.requests = Counter(
            "baton_requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.prompt_tokens = Counter("baton_prompt_tokens", "Prompt tokens", registry=r)
        self.output_tokens = Counter("baton_output_tokens", "Generated tokens", registry=r)
        self.in_flight = Gauge("baton_requests_in_flight", "Requests being served", registry=r)
        self.queue = Gauge(
            "baton_queue_depth",
            "Published queue depth per role (prefill: pending prompt tokens; decode: "
            "requests waiting for KV space)",
            ["role"],
            registry=r,
        )
        self.live = Gauge("baton_live_instances", "Live instances per role", ["role"], registry=r)
        self.cached_tokens = Counter(
            "baton_prompt_cached_tokens", "Prompt tokens whose KV was reused", registry=r
        )
        self.predicted_cached_tokens = Counter(
            "baton_router_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen prefill to reuse",
            registry=r,
        )
        self.predictions = Counter(
            "baton_router_predictions",
            "Requests by how the router's cached-token prediction compared with what was "
            "reused (exact, over: predicted more, under: predicted less)",
            ["outcome"],
            registry=r,
        )

        self.failovers = Counter(
            "baton_failovers",
            "Requests moved to another decode instance mid-stream, by why (lost: its stream "
            "broke; hung: it left membership; stalled: no progress; failed: it reported an "
            "internal error; migrated: it drained)",
            ["reason"],
            registry=r,
        )
        self.resume_gap = latency_histogram(
            r,
            "baton_resume_gap_seconds",
            "From noticing a decode instance failed to the next token from its successor",
        )
        self.recomputed_tokens = Counter(
            "baton_resume_recomputed_tokens",
            "Tokens a resumed request's new decode instance computed again (past the "
            "replication watermark)",
            registry=r,
        )

    def observe_cache(self, predicted: int, actual: int) -> None:
        self.cached_tokens.inc(actual)
        self.predicted_cached_tokens.inc(predicted)
        outcome = "exact" if predicted == actual else ("over" if predicted > actual else "under")
        self.predictions.labels(outcome).inc()

    def render(self, refresh: Callable[[], None]) -> bytes:
        refresh()
        return generate_latest(self.registry)
