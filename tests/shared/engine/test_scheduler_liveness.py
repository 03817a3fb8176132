"""The scheduler never wedges under KV pressure: requests prefilled elsewhere, whose
prompt KV loads asynchronously into slots they hold before their first token arrives,
must not take the pool so that none of them can compute, nor wait behind a request
that needs slots they hold. No model; the fake connector stands in for the KV store."""

from __future__ import annotations

import random

import pytest

from shared.engine.request import Request, SampledToken
from shared.engine.scheduler import Scheduler
from shared.engine.swap import SwapCostModel, Swapper
from tests.shared.engine.fake_connector import FakeConnector
from tests.shared.engine.stepping import make, req, run_step, run_until


def prefilled_elsewhere(
    s: Scheduler, fake: FakeConnector, n_prompt: int, max_tokens: int
) -> Request:
    r = req(n_prompt, max_tokens=max_tokens)
    fake.offer(r, n_prompt, asynchronous=True)
    r.awaiting_first_token = True
    s.add(r)
    return r


def test_loads_leave_each_request_holding_slots_room_for_its_next_token() -> None:
    # block-aligned prompts: each needs one more slot for the token after its prompt
    fake = FakeConnector()
    s = make(num_blocks=8, connector=fake)
    rs = [prefilled_elsewhere(s, fake, 8, max_tokens=3) for _ in range(4)]
    run_step(s)
    assert len(fake.loads) < 4  # four 2-slot loads would fill the pool with no room to grow
    for r in rs:
        s.supply_first_token(r.request_id, SampledToken(50))

    def settle() -> bool:
        for rid in list(fake.loads):
            fake.end_load(rid)
        return all(r.is_finished for r in rs)

    run_until(s, settle, limit=60)
    assert all(r.output_token_ids == [50, 100, 100] for r in rs)
    assert s.kv.num_free == s.kv.num_slots


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("preemption", ["recompute", "swap", "spill"])
def test_every_request_finishes_under_pressure(seed: int, preemption: str) -> None:
    """Random prompt lengths, load times and first-token arrivals against a pool that
    holds a few of them, with decodes growing and preempting (recomputing, swapping to
    host memory, or spilling: resuming from a load and computing the tail): all finish."""
    rng = random.Random(seed)
    fake = FakeConnector(keep_spills=preemption == "spill")
    host_blocks = 16 if preemption == "swap" else 0
    sw = None
    if preemption != "recompute":
        sw = Swapper(host_blocks, block_bytes=100, cost=SwapCostModel(), always=True)
    s = make(num_blocks=12, budget=32, connector=fake, swapper=sw)
    rs = [
        prefilled_elsewhere(s, fake, 4 * rng.randrange(1, 6), max_tokens=rng.randrange(2, 20))
        for _ in range(10)
    ]
    tokens_at = {r.request_id: rng.randrange(0, 12) for r in rs}
    step = 0

    def advance() -> bool:
        nonlocal step
        step += 1
        for r in rs:
            if r.awaiting_first_token and step >= tokens_at[r.request_id]:
                s.supply_first_token(r.request_id, SampledToken(50))
        for rid in list(fake.loads):
            if rng.random() < 0.5:
                fake.end_load(rid)
        return all(r.is_finished for r in rs)

    run_until(s, advance, limit=400)
    for r in rs:
        assert r.output_token_ids == [50] + [100] * (r.params.max_tokens - 1)
