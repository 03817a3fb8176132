"""Prometheus helpers shared by the services (each keeps its own registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def latency_histogram(registry: CollectorRegistry, name: str, doc: str) -> Histogram:
    """A seconds histogram with buckets from a millisecond to two minutes."""
    return Histogram(name, doc, registry=registry, buckets=LATENCY_BUCKETS)
