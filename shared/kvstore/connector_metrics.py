"""Prometheus metrics of prefix reuse and KV movement (one set per instance).

Prefix reuse is also exported under vLLM's names, in tokens: ``vllm:prefix_cache_*``
for the local pool (vLLM's GPU prefix cache) and ``vllm:external_prefix_cache_*`` for
the KV store (vLLM's KV connector), whose queries are the tokens the pool lacked.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.engine.request import CacheHit
from shared.serving.metrics import latency_histogram, vllm_counter


class ConnectorMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str = ""):
        r = registry
        self.model_name = model_name  # vLLM's label (see :meth:`bind`)
        self._queried_tokens = 0  # running sums behind hit_rate() (for membership load)
        self._hit_tokens = 0
        self.queried = Counter(
            "baton_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix caches (local pool, then the KV store)",
            registry=r,
        )
        self.hits = Counter(
            "baton_prefix_cache_hit_tokens",
            "Prompt tokens not computed because their KV was reused",
            ["source"],
            registry=r,
        )
        self.stale = Counter(
            "baton_prefix_cache_stale",
            "Cached blocks the index or a lease promised but a load could not deliver "
            "(recomputed instead)",
            registry=r,
        )
        self.declined = Counter(
            "baton_prefix_cache_declined_tokens",
            "Cached tokens recomputed because the cost model found pulling slower",
            registry=r,
        )
        self.loaded_bytes = Counter(
            "baton_kv_loaded_bytes", "KV bytes pulled from the store into the pool", registry=r
        )
        self.saved_bytes = Counter(
            "baton_kv_saved_bytes", "KV bytes written from the pool to the store", registry=r
        )
        self.load_s = latency_histogram(r, "baton_kv_load_seconds", "Duration of one KV load")
        self.replicated_bytes = Counter(
            "baton_kv_replicated_bytes",
            "KV bytes decode wrote to the store (blocks it completed)",
            registry=r,
        )
        self.replication_lag = Histogram(
            "baton_kv_replication_lag_tokens",
            "Tokens computed but not yet committed in the store, at each replication write",
            registry=r,
            buckets=(0, 16, 32, 64, 128, 256, 512, 1024),
        )
        self.crossover = Gauge(
            "baton_kv_pull_crossover_tokens",
            "Fewest cached tokens for which pulling beats recomputing (measured)",
            registry=r,
        )

        self.vllm_queries = vllm_counter(
            r,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.vllm_hits = vllm_counter(
            r, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.vllm_external_queries = vllm_counter(
            r,
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.vllm_external_hits = vllm_counter(
            r,
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )

    def bind(self, model_name: str) -> None:
        """The engine has loaded ``model_name``: vLLM's series carry it (at 0 from now)."""
        self.model_name = model_name
        for counter in (
            self.vllm_queries,
            self.vllm_hits,
            self.vllm_external_queries,
            self.vllm_external_hits,
        ):
            counter.labels(model_name)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        self.loaded_bytes.inc(nbytes)
        self.load_s.observe(seconds)

    def hit_rate(self) -> float | None:
        """Share of the prompt tokens looked up here whose KV was reused (None: none yet)."""
        return self._hit_tokens / self._queried_tokens if self._queried_tokens else None

    def observe_hit(self, num_prompt_tokens: int, hit: CacheHit) -> None:
        """A prompt computed here, less what was reused (once per request)."""
        self._queried_tokens += num_prompt_tokens
        self._hit_tokens += hit.local_tokens + hit.external_tokens
        self.queried.inc(num_prompt_tokens)
        self.hits.labels("local").inc(hit.local_tokens)
        self.hits.labels("store").inc(hit.external_tokens)
        m = self.model_name
        self.vllm_queries.labels(m).inc(num_prompt_tokens)
        self.vllm_hits.labels(m).inc(hit.local_tokens)
        self.vllm_external_queries.labels(m).inc(num_prompt_tokens - hit.local_tokens)
        self.vllm_external_hits.labels(m).inc(hit.external_tokens)
