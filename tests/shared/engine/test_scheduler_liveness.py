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
    s: Scheduler, fake: FakeConnector, n_prompt: int, max_tokens: int, first: int = 10
) -> Request:
    r = req(n_prompt, max_tokens=max_tokens, first=first)
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


def test_a_request_that_fills_the_pool_is_admitted() -> None:
    fake = FakeConnector()
    s = make(num_blocks=5, connector=fake)
    r = prefilled_elsewhere(s, fake, 18, max_tokens=2)  # 19 tokens of KV: all 5 slots
    s.supply_first_token(r.request_id, SampledToken(50))
    run_step(s)
    fake.end_load(r.request_id)
    run_until(s, lambda: r.is_finished, limit=10)
    assert r.output_token_ids == [50, 100]


def test_a_running_request_takes_slots_from_a_loaded_one_before_preempting_itself() -> None:
    # two requests that each need most of the pool, recomputing when preempted: the
    # running one must not give up its work to the one that only loaded its prompt
    fake = FakeConnector()
    s = make(num_blocks=12, budget=64, connector=fake, caching=False)
    a = prefilled_elsewhere(s, fake, 8, max_tokens=36, first=0)
    b = prefilled_elsewhere(s, fake, 8, max_tokens=36, first=1000)
    for r in (a, b):
        s.supply_first_token(r.request_id, SampledToken(50))
    run_step(s)
    fake.end_load(a.request_id)
    run_until(s, lambda: a.num_tokens > 36, limit=60)  # a runs; b is still loading
    fake.end_load(b.request_id)  # b lands, holding 2 of the 2 slots a will need
    run_until(s, lambda: a.is_finished, limit=20)
    assert s.preemption.num_preemptions == 1  # b gave its slots up, not a its work
    assert not b.slots and b in s.queues.waiting

    def settle() -> bool:
        for rid in list(fake.loads):
            fake.end_load(rid)
        return b.is_finished

    run_until(s, settle, limit=60)
    assert a.output_token_ids == b.output_token_ids == [50] + [100] * 35


SHAPES = {  # pool blocks, requests, chance that a load in flight ends at each step
    "many small": (12, 10, 0.5),
    "near the pool size": (5, 4, 0.3),
    "slow loads": (8, 6, 0.2),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("preemption", ["recompute", "swap", "spill"])
@pytest.mark.parametrize("caching", [True, False])
def test_every_request_finishes_under_pressure(shape: str, preemption: str, caching: bool) -> None:
    """Random prompt and output lengths (some near the pool's size), load times and
    first-token arrivals, with decodes growing and preempting (recomputing, swapping to
    host memory, or spilling: resuming from a load and computing the tail): every
    request finishes with its tokens, and every slot comes back."""
    for seed in range(25):
        finish_all(random.Random(seed), *SHAPES[shape], preemption, caching)


def finish_all(
    rng: random.Random, blocks: int, n: int, p_load: float, preemption: str, caching: bool
) -> None:
    fake = FakeConnector(keep_spills=preemption == "spill")
    sw = None
    if preemption != "recompute":
        host_blocks = 16 if preemption == "swap" else 0
        sw = Swapper(host_blocks, block_bytes=100, cost=SwapCostModel(), always=True)
    s = make(num_blocks=blocks, budget=32, connector=fake, swapper=sw, caching=caching)
    rs = []
    for i in range(n):
        n_prompt = rng.randrange(1, min(24, blocks * 4 - 1))
        max_tokens = rng.randrange(2, blocks * 4 - n_prompt + 1)  # fits the pool
        rs.append(prefilled_elsewhere(s, fake, n_prompt, max_tokens, first=1000 * i))
    tokens_at = {r.request_id: rng.randrange(0, 30) for r in rs}
    step = 0

    def advance() -> bool:
        nonlocal step
        step += 1
        for r in rs:
            if r.awaiting_first_token and step >= tokens_at[r.request_id]:
                s.supply_first_token(r.request_id, SampledToken(50))
        for rid in list(fake.loads):
            if rng.random() < p_load:
                fake.end_load(rid)
        return all(r.is_finished for r in rs)

    run_until(s, advance, limit=3000)
    for r in rs:
        assert r.output_token_ids == [50] + [100] * (r.params.max_tokens - 1)
    for rid in list(fake.loads):  # a finished request's load still in flight ends
        fake.end_load(rid)
    run_step(s)
    assert not s.queues.requests and s.kv.num_free == s.kv.num_slots
