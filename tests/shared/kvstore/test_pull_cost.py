"""Pull or recompute: the cost model's loads, its decisions and its crossover, with and
without a pool that keeps its sliding layers only for their window."""

from __future__ import annotations

import math

import pytest

from shared.kvstore.pull_cost import PullCost


def brute_crossover(cost: PullCost, limit: int = 200_000) -> float:
    return next((n for n in range(1, limit) if cost.worth_pulling(n)), math.inf)


@pytest.mark.parametrize(
    ("bandwidth", "latency_s"), [(1e9, 2e-3), (2e8, 5e-2), (5e7, 1e-2), (1e7, 1e-3)]
)
def test_the_crossover_is_where_pulling_starts_to_win(bandwidth: float, latency_s: float) -> None:
    for window in (0, 512):
        cost = PullCost(
            18_000, bandwidth=bandwidth, latency_s=latency_s, compute_rate=1000.0,
            window=window, window_bytes_per_token=15_000 if window else 0,
        )  # fmt: skip
        want = brute_crossover(cost)
        got = cost.crossover_tokens()
        assert (got == want == math.inf) or math.ceil(got - 1e-9) == want, (window, got, want)


def test_a_window_makes_long_loads_cheaper() -> None:
    full = PullCost(18_000, bandwidth=1e8, latency_s=0.0, compute_rate=10_000.0)
    kept = PullCost(
        18_000, bandwidth=1e8, latency_s=0.0, compute_rate=10_000.0,
        window=512, window_bytes_per_token=15_000,
    )  # fmt: skip
    assert kept.load_bytes(400) == full.load_bytes(400) == 400 * 18_000
    assert kept.load_bytes(4000) == 4000 * 3000 + 528 * 15_000
    # 18 KB a token at 100 MB/s is slower than 10,000 tokens/s of compute; 5 KB is not
    assert not full.worth_pulling(4000) and kept.worth_pulling(4000)
