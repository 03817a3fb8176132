"""Preemption: what becomes of a preempted request's KV. Its own bookkeeping with fake
requests' slots, then whole swaps and spills through a scheduler with no model (a real
KV cache manager and block keys; the KV store is a fake connector the test drives)."""

from __future__ import annotations

from shared.engine.kv_cache_manager import Slot
from shared.engine.preemption import Preemption
from shared.engine.request import FinishReason, Request, RequestId, RequestStatus
from shared.engine.swap import SwapCostModel, Swapper
from tests.shared.engine.fake_connector import FakeConnector
from tests.shared.engine.stepping import assert_idle, make, req, run_step, run_until


def swapper(host_blocks: int) -> Swapper:
    return Swapper(num_host_blocks=host_blocks, block_bytes=100, cost=SwapCostModel(), always=True)


def computed(n_prompt: int, n_computed: int, block_size: int = 4) -> Request:
    """A request that has computed ``n_computed`` tokens into consecutive slots."""
    r = req(n_prompt, max_tokens=32)
    r.output_token_ids = [100] * max(0, n_computed + 1 - n_prompt)
    r.num_computed_tokens = n_computed
    r.slots = [Slot(i) for i in range(-(-n_computed // block_size))]
    return r


def test_a_swap_moves_the_window_parts_a_request_holds_and_brings_back_those_it_needs() -> None:
    """Sliding-window layers (a fake part lookup: two slots per block): blocks 2 and 3
    hold parts, so 4 block slots and 4 part slots go out; back in, a request whose
    window starts at block 3 takes back only block 3's part (block 2's stays behind)."""
    parts = {Slot(i): (Slot(100 + 2 * i), Slot(101 + 2 * i)) for i in range(20)}
    p = Preemption(swapper(16), None, block_size=4, window_part=parts.get)
    r = computed(8, 14)
    r.window_from = 2
    p.evict(r)
    out = p.take_plan().copy_out
    assert r.swapped is not None and r.swapped.window_from == 2
    assert [c.slot for c in out] == [0, 1, 2, 3, 104, 105, 106, 107]
    host_of = {c.slot: c.host for c in out}
    r.window_from = 3
    p.swap_in(r, [Slot(10), Slot(11), Slot(12), Slot(13)])
    back = {c.slot: c.host for c in p.take_plan().copy_in}
    assert back == {
        Slot(10): host_of[Slot(0)],
        Slot(11): host_of[Slot(1)],
        Slot(12): host_of[Slot(2)],
        Slot(13): host_of[Slot(3)],
        Slot(126): host_of[Slot(106)],  # block 13's part gets block 3's
        Slot(127): host_of[Slot(107)],
    }
    assert p.swapper is not None and p.swapper.num_free == 16


def test_without_a_swapper_a_preempted_request_starts_over() -> None:
    p = Preemption(None, None, block_size=4)
    r = computed(8, 10)
    p.evict(r)
    assert r.num_computed_tokens == 0 and r.swapped is None and not r.spilled
    assert p.num_preemptions == 1 and not p.take_plan()


def test_a_swap_out_plans_one_copy_per_computed_block_and_the_plan_is_taken_once() -> None:
    sw = swapper(8)
    p = Preemption(sw, None, block_size=4)
    r = computed(8, 10)
    p.evict(r)
    assert r.swapped is not None and r.swapped.num_tokens == 10
    assert r.num_computed_tokens == 10  # it resumes from here
    plan = p.take_plan()
    assert [c.slot for c in plan.copy_out] == [Slot(0), Slot(1), Slot(2)]
    assert not plan.copy_in and not p.take_plan()
    hosts = r.swapped.host_blocks
    p.swap_in(r, [Slot(7), Slot(8), Slot(9), Slot(10)])
    plan = p.take_plan()
    assert [c.slot for c in plan.copy_in] == [Slot(7), Slot(8), Slot(9)]
    assert tuple(c.host for c in plan.copy_in) == hosts
    assert r.swapped is None and sw.num_free == 8  # free: nothing copies out this step


def test_with_the_host_full_the_connector_is_asked_and_a_refusal_counts_as_no_room() -> None:
    sw = swapper(0)
    refusing = Preemption(sw, FakeConnector(keep_spills=False), block_size=4)
    r = computed(8, 10)
    refusing.evict(r)
    assert not r.spilled and r.num_computed_tokens == 0
    assert (sw.stats.spills_out, sw.stats.recomputes_no_room) == (0, 1)
    keeping = Preemption(sw, FakeConnector(keep_spills=True), block_size=4)
    r = computed(8, 10)
    keeping.evict(r)
    assert r.spilled and r.num_computed_tokens == 0 and sw.stats.spills_out == 1


def test_spilled_kv_counts_in_only_past_the_prompt_and_only_when_its_load_ends() -> None:
    sw = swapper(0)
    p = Preemption(sw, FakeConnector(keep_spills=True), block_size=4)
    loading, failing, prompt_only, aborted = (computed(8, 16) for _ in range(4))
    for r in (loading, failing, prompt_only, aborted):
        p.evict(r)
    p.resumed(loading, local=0, computed=16, pending=True)
    p.resumed(failing, local=0, computed=16, pending=True)
    p.resumed(prompt_only, local=0, computed=8, pending=False)
    p.resumed(aborted, local=0, computed=12, pending=True)
    assert not any(r.spilled for r in (loading, failing, prompt_only, aborted))
    assert sw.stats.spills_in == 0
    p.load_ended(failing.request_id, ok=False)
    p.discard(aborted)
    p.load_ended(loading.request_id, ok=True)
    p.load_ended(loading.request_id, ok=True)  # counted once
    assert (sw.stats.spills_in, sw.stats.spilled_tokens_in) == (1, 8)
    local = computed(8, 16)
    p.evict(local)
    p.resumed(local, local=12, computed=16, pending=False)  # 12 of it were still here
    assert (sw.stats.spills_in, sw.stats.spilled_tokens_in) == (2, 12)


def test_a_request_that_never_spilled_is_not_counted_when_it_loads() -> None:
    sw = swapper(0)
    p = Preemption(sw, FakeConnector(keep_spills=True), block_size=4)
    r = computed(8, 16)
    p.resumed(r, local=0, computed=16, pending=False)
    assert sw.stats.spills_in == 0


def test_a_swapped_out_request_resumes_where_it_was() -> None:
    """The victim's computed blocks are copied out in the step that preempts it and back
    in (the same host blocks, into fresh slots) in the step that resumes it, which then
    computes one token, not its whole context."""
    swapper = Swapper(num_host_blocks=8, block_bytes=100, cost=SwapCostModel(), always=True)
    s = make(num_blocks=5, budget=64, swapper=swapper)
    a = req(8, max_tokens=12)
    b = req(8, max_tokens=12, first=40)
    s.add(a)
    s.add(b)
    run_step(s)
    out = run_step(s)
    while not out.preempted:
        out = run_step(s)
    assert out.preempted == (b.request_id,)
    assert b.swapped is not None and b.status is RequestStatus.PREEMPTED
    computed = b.num_computed_tokens
    assert computed == b.num_tokens - 1 and not b.slots
    assert len(out.swaps.copy_out) == len(b.swapped.host_blocks) == -(-computed // 4)
    assert not out.swaps.copy_in
    hosts = b.swapped.host_blocks
    while not out.swaps.copy_in:
        out = run_step(s)
    assert [c.host for c in out.swaps.copy_in] == list(hosts)
    assert [c.slot for c in out.swaps.copy_in] == b.slots[: len(hosts)]
    assert b.num_computed_tokens == computed + 1
    assert [x.num_new_tokens for x in out.scheduled if x.request is b] == [1]
    assert b.swapped is None and swapper.num_free == 8
    while s.has_unfinished():
        run_step(s)
    assert len(b.output_token_ids) == 12 and a.is_finished
    assert (swapper.stats.swaps_out, swapper.stats.swaps_in) == (1, 1)
    assert_idle(s)


def test_aborting_a_swapped_out_request_frees_its_host_blocks() -> None:
    swapper = Swapper(num_host_blocks=8, block_bytes=100, cost=SwapCostModel(), always=True)
    s = make(num_blocks=5, budget=64, swapper=swapper)
    a, b = req(8, max_tokens=12), req(8, max_tokens=12, first=40)
    s.add(a)
    s.add(b)
    while b.swapped is None:
        run_step(s)
    assert swapper.num_free < 8
    s.finish(b.request_id, FinishReason.ABORT)
    assert swapper.num_free == 8 and b.swapped is None
    while s.has_unfinished():
        run_step(s)
    assert_idle(s)


def test_without_room_in_host_memory_preemption_recomputes() -> None:
    swapper = Swapper(num_host_blocks=1, block_bytes=100, cost=SwapCostModel(), always=True)
    s = make(num_blocks=5, budget=64, swapper=swapper)
    a, b = req(8, max_tokens=12), req(8, max_tokens=12, first=40)
    s.add(a)
    s.add(b)
    preempted: list[RequestId] = []
    while s.has_unfinished():
        preempted += run_step(s).preempted
    assert preempted and swapper.stats.swaps_out == 0
    assert swapper.stats.recomputes_no_room == len(preempted)
    assert len(b.output_token_ids) == 12
    assert_idle(s)


def test_without_room_in_host_memory_a_preempted_request_spills_to_the_connector() -> None:
    """No host swap space: the victim's KV is handed to the connector while its slots
    still hold it; resuming loads the whole blocks it kept and computes only the rest."""
    fake = FakeConnector(keep_spills=True)
    swapper = Swapper(num_host_blocks=0, block_bytes=100, cost=SwapCostModel(), always=True)
    s = make(num_blocks=5, budget=64, connector=fake, swapper=swapper)
    a, b = req(6, max_tokens=12), req(6, max_tokens=12, first=40)
    s.add(a)
    s.add(b)
    run_until(s, lambda: b.spilled)
    assert len(fake.spilled[b.request_id]) >= 2  # its slots, intact at the call
    assert not b.slots and b.status is RequestStatus.PREEMPTED
    assert swapper.stats.spills_out == 1 and swapper.stats.recomputes_no_room == 0
    run_until(s, lambda: b.request_id in fake.loads)
    assert not b.spilled and swapper.stats.spills_in == 0  # counted once the load ends
    kept = fake.offers[b.request_id].num_tokens
    assert b.status is RequestStatus.WAITING_FOR_KV and kept % 4 == 0 and kept >= 8
    fake.end_load(b.request_id)
    context = b.num_tokens
    out = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled if x.request is b] == [context - kept]
    assert swapper.stats.spills_in == 1 and not b.spilled
    assert swapper.stats.spilled_tokens_in == kept - b.num_prompt_tokens
    while s.has_unfinished():
        run_step(s)
    assert len(b.output_token_ids) == 12 and a.is_finished
    assert_idle(s)


def test_a_spill_whose_load_fails_recomputes() -> None:
    fake = FakeConnector(keep_spills=True)
    swapper = Swapper(num_host_blocks=0, block_bytes=100, cost=SwapCostModel(), always=True)
    s = make(num_blocks=5, budget=64, connector=fake, swapper=swapper)
    a, b = req(8, max_tokens=12), req(8, max_tokens=12, first=40)
    s.add(a)
    s.add(b)
    run_until(s, lambda: b.request_id in fake.loads)
    assert swapper.stats.spills_out == 1
    fake.end_load(b.request_id, ok=False)
    run_step(s)
    assert not b.spilled and not b.load_external and swapper.stats.spills_in == 0
    while s.has_unfinished():
        run_step(s)
    assert len(b.output_token_ids) == 12
    assert_idle(s)


def test_a_spill_that_comes_back_with_only_its_prompt_is_not_counted_in() -> None:
    """The store kept nothing past the prompt by the time it resumes (say it evicted the
    answer's blocks): the load brings the prompt, the rest is recomputed, and the spill
    does not count as KV coming back."""
    fake = FakeConnector(keep_spills=True)
    swapper = Swapper(num_host_blocks=0, block_bytes=100, cost=SwapCostModel(), always=True)
    s = make(num_blocks=5, budget=64, connector=fake, swapper=swapper)
    a, b = req(8, max_tokens=12), req(8, max_tokens=12, first=40)
    s.add(a)
    s.add(b)
    run_until(s, lambda: b.spilled)
    fake.offer(b, b.num_prompt_tokens, asynchronous=True)
    run_until(s, lambda: b.request_id in fake.loads)
    assert not b.spilled
    fake.end_load(b.request_id)
    run_until(s, lambda: not s.has_unfinished())
    assert swapper.stats.spills_out == 1 and swapper.stats.spills_in == 0
    assert swapper.stats.spilled_tokens_in == 0 and len(b.output_token_ids) == 12
    assert_idle(s)
