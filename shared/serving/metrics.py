"""Prometheus helpers shared by the services (each keeps its own registry).

Every service exports Baton's own series (``baton_*``). Where vLLM (V1) has a name for
the same quantity, it is exported as well under vLLM's name, type, buckets and label
(``model_name``: the served model's name), so that a vLLM Grafana dashboard works
unchanged against a Baton cluster. Each process is scraped on its own and vLLM's
dashboards sum over instances, so each series comes from the process that sees it:

- gateway, the whole request across roles (what vLLM's API server sees):
  ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:request_time_per_output_token_seconds``, ``vllm:e2e_request_latency_seconds``,
  ``vllm:request_decode_time_seconds``, ``vllm:prompt_tokens``,
  ``vllm:generation_tokens``, ``vllm:request_success`` (``finished_reason``),
  ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``;
- every worker (prefill, decode, colocated), its own engine:
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc``;
- the workers that compute prompts (prefill, colocated): ``vllm:request_queue_time_seconds``,
  ``vllm:request_prefill_time_seconds``, ``vllm:prefix_cache_queries``/``_hits`` (the
  local pool, in tokens) and ``vllm:external_prefix_cache_queries``/``_hits`` (the KV
  store). Decode loads every prompt prefill computed; counting those loads as cache
  hits would only distort the cluster's hit rate, so decode's stay at 0.

Workers also export ``baton_instance_info{role,instance_id,model_name} 1``: join on it
(``* on(job, instance) group_left(role) baton_instance_info``) to split any worker
series by role. Baton's own series keep Baton's definitions where they differ (e.g.
``baton_tpot_seconds`` leaves out single-token answers; vLLM records those as 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

MODEL_LABEL = "model_name"
# vLLM's default bucket boundaries (vllm/v1/metrics), one layout per family
VLLM_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5),
    *(5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
VLLM_ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
    *(5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
VLLM_REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)


def latency_histogram(registry: CollectorRegistry, name: str, doc: str) -> Histogram:
    """A seconds histogram with buckets from a millisecond to two minutes."""
    return Histogram(name, doc, registry=registry, buckets=LATENCY_BUCKETS)


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's buckets for per-request token counts: 1, 2, 5, 10, 20, ... up to the
    context length."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(float(mantissa * scale))
        scale *= 10


def vllm_histogram(
    registry: CollectorRegistry, name: str, doc: str, buckets: Sequence[float]
) -> Histogram:
    return Histogram(name, doc, [MODEL_LABEL], registry=registry, buckets=buckets)


def vllm_counter(registry: CollectorRegistry, name: str, doc: str) -> Counter:
    return Counter(name, doc, [MODEL_LABEL], registry=registry)


def vllm_gauge(registry: CollectorRegistry, name: str, doc: str) -> Gauge:
    return Gauge(name, doc, [MODEL_LABEL], registry=registry)
