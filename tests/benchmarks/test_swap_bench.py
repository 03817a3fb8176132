"""The swap benchmark's sizing: the decode pool as a share of the load's working set."""

from __future__ import annotations

import pytest

from benchmarks.swap_bench import LAYOUT, parse_args, pool_gb


def test_the_pool_is_the_asked_share_of_what_the_requests_in_flight_need() -> None:
    args = parse_args(["--concurrency", "16", "--input-len", "512", "--output-len", "256"])
    working_set = 16 * 768 * LAYOUT.bytes_per_token
    assert pool_gb(args, LAYOUT.bytes_per_token) == pytest.approx(0.5 * working_set / (1 << 30))
    args = parse_args(["--pool-share", "0.25"])
    assert pool_gb(args, 1000) == pytest.approx(0.25 * 16 * 768 * 1000 / (1 << 30))
