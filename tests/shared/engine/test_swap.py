"""Swapping's pure parts: the cost model's choice and the host block bookkeeping."""

from __future__ import annotations

import pytest

from shared.engine.kv_cache_manager import Slot
from shared.engine.swap import (
    MIN_COMPUTE_TOKENS,
    BlockCopy,
    CheaperToRecompute,
    HostBlock,
    HostSwapFull,
    PreemptionMode,
    SwapCostModel,
    Swapper,
    SwapPlan,
)

MB = 1 << 20


def measured(copy_bytes_s: float, compute_tokens_s: float) -> SwapCostModel:
    cost = SwapCostModel(prior_copy_bytes_s=copy_bytes_s)
    cost.observe_compute(1000, 1000 / compute_tokens_s)
    return cost


def test_swaps_when_copying_out_and_back_beats_recomputing() -> None:
    # 1000 tokens of 46 KB: 46 MB out and back at 4 GB/s = 23 ms; recompute at 2000 tok/s
    # = 500 ms
    cost = measured(copy_bytes_s=4e9, compute_tokens_s=2000)
    assert cost.choose(1000, 46 * 1000 * 1000) is PreemptionMode.SWAP


def test_recomputes_when_the_copy_is_slower() -> None:
    # a slow tier (0.1 GB/s) and a fast engine (50k tok/s): 920 ms of copies vs 20 ms
    cost = measured(copy_bytes_s=1e8, compute_tokens_s=50_000)
    assert cost.choose(1000, 46 * MB) is PreemptionMode.RECOMPUTE
    assert cost.swap_seconds(46 * MB) == pytest.approx(2 * 46 * MB / 1e8)
    assert cost.recompute_seconds(1000) == pytest.approx(0.02)


def test_before_any_compute_is_measured_it_swaps() -> None:
    cost = SwapCostModel()
    assert cost.recompute_seconds(100) is None
    assert cost.choose(100, 100 * MB) is PreemptionMode.SWAP
    cost.observe_compute(MIN_COMPUTE_TOKENS - 1, 0.001)  # too small a step to count
    assert cost.compute_tokens_s is None


def test_measurements_move_the_estimates_gradually() -> None:
    cost = SwapCostModel(prior_copy_bytes_s=1e9)
    cost.observe_copy(4 * MB, 4 * MB / 3e9)
    assert 1e9 < cost.copy_bytes_s < 3e9
    cost.observe_copy(0, 1.0)  # nothing moved: ignored
    cost.observe_copy(MB, 0.0)
    assert 1e9 < cost.copy_bytes_s < 3e9
    cost.observe_compute(100, 0.1)
    cost.observe_compute(100, 0.05)
    assert cost.compute_tokens_s is not None and 1000 < cost.compute_tokens_s < 2000


def test_swapper_hands_out_host_blocks_and_takes_them_back() -> None:
    sw = Swapper(num_host_blocks=4, block_bytes=1000, cost=SwapCostModel(), always=True)
    swapped, copies = sw.swap_out([Slot(7), Slot(3)], num_tokens=30)
    assert [c.slot for c in copies] == [7, 3]
    assert list(swapped.host_blocks) == [c.host for c in copies]
    assert swapped.num_tokens == 30 and sw.num_free == 2
    back = sw.swap_in(swapped, [Slot(1), Slot(2)])
    h0, h1 = swapped.host_blocks
    assert back == [BlockCopy(Slot(1), h0), BlockCopy(Slot(2), h1)]
    assert sw.num_free == 4
    assert (sw.stats.swaps_out, sw.stats.swaps_in) == (1, 1)
    assert (sw.stats.bytes_out, sw.stats.bytes_in) == (2000, 2000)
    with pytest.raises(ValueError):
        sw.swap_in(swapped, [Slot(1)])


def test_swapper_recomputes_when_full_or_cheaper_and_counts_why() -> None:
    sw = Swapper(num_host_blocks=2, block_bytes=1000, cost=SwapCostModel(), always=True)
    with pytest.raises(HostSwapFull):
        sw.swap_out([Slot(0), Slot(1), Slot(2)], 12)
    assert sw.num_free == 2  # the scheduler counts it: a spill, or a recompute for no room
    swapped, _ = sw.swap_out([Slot(0), Slot(1)], 8)
    sw.discard(swapped)  # aborted while swapped out
    assert sw.num_free == 2
    cheap = Swapper(2, 10**9, measured(copy_bytes_s=1e8, compute_tokens_s=1e6))
    with pytest.raises(CheaperToRecompute):
        cheap.swap_out([Slot(0)], 16)
    assert cheap.stats.recomputes == 1
    # no room: the host cost model is not asked (the connector's tier prices itself)
    with pytest.raises(HostSwapFull):
        cheap.swap_out([Slot(0), Slot(1), Slot(2)], 16)
    assert cheap.stats.recomputes == 1


def test_a_step_copies_out_or_in_never_both() -> None:
    c = BlockCopy(Slot(0), HostBlock(0))
    assert SwapPlan((c,)) and SwapPlan(copy_in=(c,)) and not SwapPlan()
    with pytest.raises(ValueError):
        SwapPlan((c,), (c,))
