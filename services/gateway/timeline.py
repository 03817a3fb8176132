"""One request's latency bookkeeping: TTFT, ITL, TPOT, E2E and its outcome, into the
gateway's metrics (vLLM's serving-benchmark definitions) and one summary log line."""

from __future__ import annotations

import logging
import time

from services.gateway.handoff import CacheReport
from services.gateway.metrics import ChoiceTimes, GatewayMetrics

log = logging.getLogger(__name__)


class Timeline:
    """Per-request latency bookkeeping (vLLM's serving-benchmark definitions). With ``n``
    choices, TTFT is the first token of any, ITL is per choice, E2E ends at the last."""

    def __init__(self, metrics: GatewayMetrics, client_id: str | None):
        self.metrics = metrics
        self.client_id = client_id
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.cache: CacheReport | None = None
        self.choices: dict[int, ChoiceTimes] = {}

    def token(self, index: int = 0, finish_reason: str | None = None) -> None:
        now = time.perf_counter()
        choice = self.choices.get(index)
        if choice is None:
            self.choices[index] = ChoiceTimes(now, now, finish_reason=finish_reason)
            self.metrics.first_token(now - self.start, of_request=self.first is None)
        else:
            self.metrics.next_token(now - choice.last)
            choice.add(now, finish_reason)
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += 1

    def end(self, outcome: str) -> None:
        cache = self.cache
        log.info(
            "request %s: %d tokens, ttft %s, e2e %.3fs, cached tokens %s (router predicted %s)%s",
            outcome,
            self.tokens,
            f"{self.first - self.start:.3f}s" if self.first is not None else "-",
            time.perf_counter() - self.start,
            cache.actual if cache is not None else "-",
            cache.predicted if cache is not None else "-",
            f", client request id {self.client_id!r}" if self.client_id else "",
        )
        self.metrics.finished(outcome, self.start, list(self.choices.values()))
