"""Reading a service's Prometheus ``/metrics`` from a benchmark or a test."""

from __future__ import annotations

import httpx


def metric_sum(url: str, name: str, labels: str = "", client: httpx.Client | None = None) -> float:
    """Sum of the samples at ``url``'s ``/metrics`` whose name (and, given, the start of
    their labels, e.g. ``'reason="migrated"'``) begin as given. ``client``: reuse one
    (several reads); otherwise one request on its own."""
    key = f"{name}{{{labels}" if labels else name
    if client is None:
        text = httpx.get(url + "/metrics", timeout=10).text
    else:
        text = client.get(url + "/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(key) and not line.startswith("#")
    )
