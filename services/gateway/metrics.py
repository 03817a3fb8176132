"""The gateway's Prometheus metrics (vLLM's serving definitions: TTFT, TPOT, ITL, E2E).

The request-level series are exported twice: under Baton's names, and under vLLM's
(``vllm:*``, label ``model_name``; see :mod:`shared.serving.metrics` for which process
exports which). One method records both, so the two never disagree on what was seen.
vLLM runs each of a request's ``n`` choices as a request of its own: its series count
choices (TTFT, E2E, TPOT, finish reason and generated tokens per choice), Baton's count
client requests. A request's prompt counts once either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.gateway.status_page import RecentLatencies
from shared.cluster.slo import SloWindow, judge
from shared.config import SloConfig
from shared.serving.metrics import (
    MODEL_LABEL,
    VLLM_ITL_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TTFT_BUCKETS,
    latency_histogram,
    request_tokens_buckets,
    vllm_counter,
    vllm_histogram,
)

# vLLM's ``finished_reason`` of a choice that ended without one, by the request's outcome
_UNFINISHED_REASON = {"ok": "stop", "client_gone": "abort"}


@dataclass
class ChoiceTimes:
    """When one choice of a request got its first and latest token, and how it ended."""

    first: float
    last: float
    tokens: int = 1
    finish_reason: str | None = None

    def add(self, now: float, finish_reason: str | None) -> None:
        self.last = now
        self.tokens += 1
        self.finish_reason = finish_reason or self.finish_reason


class PromptTokens:
    """Prompt tokens under both names, and vLLM's per-request prompt length histogram:
    ``inc`` once per admitted request."""

    def __init__(self, baton: Counter, total: Counter, per_request: Histogram):
        self._baton, self._total, self._per_request = baton, total, per_request

    def inc(self, n: int) -> None:
        self._baton.inc(n)
        self._total.inc(n)
        self._per_request.observe(n)


class GatewayMetrics:
    def __init__(self, model_name: str, max_model_len: int, slo: SloConfig | None = None):
        self.recent = RecentLatencies()  # the status page's sparklines
        self.slo_window = SloWindow(slo or SloConfig())  # the last minute's attainment
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
        self.ttft = latency_histogram(r, "baton_ttft_seconds", "Request arrival to first token")
        self.tpot = latency_histogram(r, "baton_tpot_seconds", "(E2E - TTFT) / (output tokens - 1)")
        self.itl = latency_histogram(r, "baton_itl_seconds", "Gap between consecutive tokens")
        self.e2e = latency_histogram(r, "baton_e2e_seconds", "Request arrival to last token")
        self.requests = Counter(
            "baton_requests", "Finished requests by outcome", ["outcome"], registry=r
        )
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
        self.lent = Gauge(
            "baton_lent_instances",
            "Mixed instances of the other role serving this role at the moment",
            ["role"],
            registry=r,
        )
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

        self.decode_opens = Counter(
            "baton_decode_opens",
            "Decode streams opened for prefilled requests, by when (alongside: as prefill "
            "starts, to pull while it computes; after_first_token: its KV comes only then)",
            ["when"],
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

        self.slo_requests = Counter(
            "baton_slo_requests",
            "Requests judged against the latency targets (BATON_SLO_TTFT, BATON_SLO_TPOT), "
            "by target (ttft, tpot, both) and outcome (met, missed); a request that failed "
            "misses every target, one whose client left is not judged",
            ["target", "outcome"],
            registry=r,
        )
        self._vllm(r, max_model_len)
        self.prompt_tokens = PromptTokens(
            Counter("baton_prompt_tokens", "Prompt tokens", registry=r),
            self.vllm_prompt_tokens,
            self.vllm_request_prompt_tokens,
        )

    def _vllm(self, r: CollectorRegistry, max_model_len: int) -> None:
        """vLLM's request-level series (names, types, buckets, documentation)."""
        m = self.model_name

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return vllm_histogram(r, name, doc, buckets).labels(m)

        def counter(name: str, doc: str) -> Counter:
            return vllm_counter(r, name, doc).labels(m)

        self.vllm_ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            VLLM_TTFT_BUCKETS,
        )
        self.vllm_itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            VLLM_ITL_BUCKETS,
        )
        self.vllm_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            VLLM_ITL_BUCKETS,
        )
        self.vllm_e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )
        self.vllm_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )
        self.vllm_prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.vllm_generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.vllm_request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            request_tokens_buckets(max_model_len),
        )
        self.vllm_request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            request_tokens_buckets(max_model_len),
        )
        self.vllm_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [MODEL_LABEL, "finished_reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort", "error"):  # at 0 from the start, as vLLM
            self.vllm_success.labels(m, reason)

    def first_token(self, seconds: float, *, of_request: bool) -> None:
        """A choice's first token, ``seconds`` after the request arrived (``of_request``:
        the request's first token, of any choice)."""
        self.vllm_ttft.observe(seconds)
        if of_request:
            self.ttft.observe(seconds)

    def next_token(self, gap: float) -> None:
        """A choice's next token, ``gap`` seconds after its previous one."""
        self.itl.observe(gap)
        self.vllm_itl.observe(gap)

    def finished(self, outcome: str, start: float, choices: Sequence[ChoiceTimes]) -> None:
        """A request that was admitted has ended (``outcome``: ok, error, client_gone)."""
        tokens = sum(c.tokens for c in choices)
        self.requests.labels(outcome).inc()
        self.output_tokens.inc(tokens)
        self.vllm_generation_tokens.inc(tokens)
        unfinished = _UNFINISHED_REASON.get(outcome, "error")
        if not choices:
            self.vllm_success.labels(self.model_name, unfinished).inc()
        for c in choices:
            self.vllm_success.labels(self.model_name, c.finish_reason or unfinished).inc()
            if c.finish_reason is None:
                continue
            decode = c.last - c.first
            self.vllm_e2e.observe(c.last - start)
            self.vllm_decode_time.observe(decode)
            self.vllm_tpot.observe(decode / (c.tokens - 1) if c.tokens > 1 else 0.0)
            self.vllm_request_generation_tokens.observe(c.tokens)
        if outcome != "ok" or not choices:
            if outcome != "client_gone":
                self._judge(None, None)
            return
        first, last = min(c.first for c in choices), max(c.last for c in choices)
        longest = max(c.tokens for c in choices)
        self.e2e.observe(last - start)
        tpot = (last - first) / (longest - 1) if longest > 1 else None
        if tpot is not None:
            self.tpot.observe(tpot)
        self.recent.record(first - start, tpot)
        self._judge(first - start, tpot)

    def _judge(self, ttft: float | None, tpot: float | None) -> None:
        window = self.slo_window
        if not window.targets.is_set:
            return
        verdict = judge(window.targets, ttft, tpot)
        window.record(verdict)
        for target, met in (("ttft", verdict.ttft), ("tpot", verdict.tpot)):
            if met is not None:
                self.slo_requests.labels(target, "met" if met else "missed").inc()
        self.slo_requests.labels("both", "met" if verdict.both else "missed").inc()

    def observe_cache(self, predicted: int, actual: int) -> None:
        self.cached_tokens.inc(actual)
        self.predicted_cached_tokens.inc(predicted)
        outcome = "exact" if predicted == actual else ("over" if predicted > actual else "under")
        self.predictions.labels(outcome).inc()

    def render(self, refresh: Callable[[], None]) -> bytes:
        refresh()
        return generate_latest(self.registry)
