"""Summing a metric's samples from Prometheus text (a fake HTTP transport serves it)."""

from __future__ import annotations

import httpx

from shared.bench.scrape import metric_sum

TEXT = """# HELP baton_failovers_total Streams moved
# TYPE baton_failovers_total counter
baton_failovers_total{reason="migrated",role="decode"} 3.0
baton_failovers_total{reason="killed",role="decode"} 2.0
baton_failovers_created{reason="killed",role="decode"} 1.7e9
baton_engine_step_seconds_count 884.0
baton_engine_step_seconds_sum 18.0
"""


def fake_client() -> httpx.Client:
    def serve(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics"
        return httpx.Response(200, text=TEXT)

    return httpx.Client(transport=httpx.MockTransport(serve))


def test_samples_of_a_name_are_summed_and_labels_narrow_them() -> None:
    with fake_client() as c:
        assert metric_sum("http://x", "baton_failovers_total", client=c) == 5.0
        assert metric_sum("http://x", "baton_failovers_total", 'reason="migrated"', client=c) == 3.0
        assert metric_sum("http://x", "baton_engine_step_seconds_count", client=c) == 884.0
        assert metric_sum("http://x", "baton_absent_total", client=c) == 0.0
