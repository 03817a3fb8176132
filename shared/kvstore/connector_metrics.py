"""Prometheus metrics of prefix reuse and KV movement (one set per instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.engine.request import CacheHit
from shared.serving.metrics import latency_histogram


class ConnectorMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
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

    def observe_load(self, nbytes: int, seconds: float) -> None:
        self.loaded_bytes.inc(nbytes)
        self.load_s.observe(seconds)

    def observe_hit(self, num_prompt_tokens: int, hit: CacheHit) -> None:
        self.queried.inc(num_prompt_tokens)
        self.hits.labels("local").inc(hit.local_tokens)
        self.hits.labels("store").inc(hit.external_tokens)
