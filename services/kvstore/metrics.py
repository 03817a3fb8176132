"""Prometheus metrics of one KV store node (own registry: no process-global state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OP_BUCKETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


class StoreMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes_in = Counter("baton_kvstore_bytes_in", "Payload bytes written", registry=r)
        self.bytes_out = Counter("baton_kvstore_bytes_out", "Payload bytes read", registry=r)
        self.local_bytes_in = Counter(
            "baton_kvstore_local_bytes_in",
            "Bytes written by same-host clients' own copies (part of bytes_in)",
            registry=r,
        )
        self.local_bytes_out = Counter(
            "baton_kvstore_local_bytes_out",
            "Bytes read by same-host clients' own copies (part of bytes_out)",
            registry=r,
        )
        self.evictions = Counter("baton_kvstore_evictions", "Blocks evicted (LRU)", registry=r)
        self.hits = Counter("baton_kvstore_hits", "Block ids found by get/lookup", registry=r)
        self.misses = Counter("baton_kvstore_misses", "Block ids not found", registry=r)
        self.reservations_expired = Counter(
            "baton_kvstore_reservations_expired", "Reservations freed by timeout", registry=r
        )
        self.errors = Counter("baton_kvstore_errors", "Refused operations", ["code"], registry=r)
        self.op_seconds = Histogram(
            "baton_kvstore_op_seconds",
            "Data-plane op latency",
            ["op"],
            buckets=OP_BUCKETS,
            registry=r,
        )
        self.blocks_held = Gauge("baton_kvstore_blocks_held", "Committed blocks", registry=r)
        self.bytes_used = Gauge("baton_kvstore_bytes_used", "Arena bytes in use", registry=r)
        self.capacity = Gauge("baton_kvstore_capacity_bytes", "Arena size in bytes", registry=r)
        self.connections = Gauge("baton_kvstore_connections", "Open data connections", registry=r)

    def lookup(self, hits: int, asked: int) -> None:
        self.hits.inc(hits)
        self.misses.inc(asked - hits)

    def reads(self, hits: int, misses: int) -> None:
        self.hits.inc(hits)
        self.misses.inc(misses)

    def bind_gauges(self, stats: Callable[[], dict[str, float]]) -> None:
        self.blocks_held.set_function(lambda: stats()["blocks_held"])
        self.bytes_used.set_function(lambda: stats()["bytes_used"])
        self.capacity.set_function(lambda: stats()["capacity_bytes"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
