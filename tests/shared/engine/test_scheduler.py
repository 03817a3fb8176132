"""Scheduler logic with a real KV cache manager and block keys, no model; KV movement
through a fake connector (a stand-in for the KV store that the test drives)."""

from __future__ import annotations

import pytest

from shared.engine.admission import ALONE_CHUNK_FACTOR
from shared.engine.request import FinishReason, Request, RequestId, RequestStatus, SampledToken
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.errors import InvalidRequestError, RequestTooLongError
from tests.shared.engine.fake_connector import FakeConnector
from tests.shared.engine.stepping import EOS, assert_idle, make, req, run_step


def test_prefill_then_decode_then_length_finish() -> None:
    s = make()
    r = req(10, max_tokens=3)
    s.add(r)
    out = run_step(s)
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == [(r, 10)]
    assert r.num_computed_tokens == 10 and r.output_token_ids == [100]
    assert len(r.slots) == 3
    out = run_step(s)
    assert out.scheduled[0].num_new_tokens == 1
    run_step(s)
    assert r.is_finished and r.finish_reason is FinishReason.LENGTH
    assert_idle(s)


def test_eos_finishes_with_stop_unless_ignored() -> None:
    s = make()
    r = req(5)
    s.add(r)
    run_step(s, token=EOS)
    assert r.finish_reason is FinishReason.STOP
    ignoring = Request(
        request_id=RequestId("ignore-eos"),
        prompt_token_ids=[5, 6, 7],
        params=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, stop_token_ids=(77,)),
        seed=0,
        arrival=0.0,
    )
    s.add(ignoring)
    run_step(s, token=EOS)
    assert not ignoring.is_finished
    run_step(s, token=77)  # an explicit stop token id still stops
    assert ignoring.finish_reason is FinishReason.STOP and ignoring.output_token_ids == [EOS, 77]


def test_token_budget_chunks_long_prompts() -> None:
    s = make(budget=8)
    r = req(20)
    s.add(r)
    sizes = []
    while not r.output_token_ids:
        out = run_step(s)
        sizes.append(out.num_batched_tokens)
        assert out.num_batched_tokens <= 8
    assert sizes == [8, 8, 4]
    assert r.num_computed_tokens == 20


@pytest.mark.parametrize("chunked", [True, False])
def test_long_prompt_arriving_while_decoding(chunked: bool) -> None:
    """Chunked: the decode and a budget-sized chunk share the step. Not chunked: the
    long prompt waits for a step it can have whole."""
    s = make(budget=16, chunked=chunked)
    a = req(4, max_tokens=10)
    s.add(a)
    run_step(s)
    b = req(30, first=50)
    s.add(b)
    out = run_step(s)
    expected = [(a, 1), (b, 15)] if chunked else [(a, 1)]
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == expected


def test_max_num_seqs_limits_the_batch() -> None:
    s = make(max_seqs=2)
    rs = [req(4) for _ in range(3)]
    for r in rs:
        s.add(r)
    out = run_step(s)
    assert {x.request.request_id for x in out.scheduled} == {rs[0].request_id, rs[1].request_id}
    assert rs[2].status is RequestStatus.WAITING


def test_prefix_cache_hit_skips_computed_blocks_but_keeps_one_token() -> None:
    s = make()
    a = req(12, max_tokens=1)
    s.add(a)
    run_step(s)
    assert a.is_finished
    b = req(12, max_tokens=1)  # same tokens
    s.add(b)
    out = run_step(s)
    # 12 tokens = 3 full blocks; the last block is recomputed so the last token has logits
    assert b.num_cached_tokens == 8
    assert out.scheduled[0].num_new_tokens == 4
    c = req(14, max_tokens=1)  # shares 3 full blocks with a
    s.add(c)
    run_step(s)
    assert c.num_cached_tokens == 12


def test_admission_waits_for_free_blocks() -> None:
    s = make(num_blocks=4)
    a = req(12, max_tokens=4)  # 3 blocks, grows to 4
    b = req(8, max_tokens=1, first=60)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [x.request for x in out.scheduled] == [a]
    assert b.status is RequestStatus.WAITING


def test_preemption_frees_the_latest_request_and_resumes_it() -> None:
    s = make(num_blocks=5, budget=64)
    a = req(8, max_tokens=12)
    b = req(8, max_tokens=12, first=40)
    s.add(a)
    s.add(b)
    run_step(s)  # 2 + 2 blocks in use, 1 free
    preempted: list[RequestId] = []
    for _ in range(40):
        if not s.has_unfinished():
            break
        preempted += run_step(s).preempted
    assert b.request_id in preempted
    assert a.is_finished and b.is_finished
    assert len(a.output_token_ids) == 12 and len(b.output_token_ids) == 12
    assert s.kv.num_free == 5


def test_abort_anywhere_frees_blocks() -> None:
    s = make()
    a, b = req(8), req(8, first=70)
    s.add(a)
    run_step(s)
    s.add(b)
    assert s.finish(a.request_id, FinishReason.ABORT) is a
    assert s.finish(b.request_id, FinishReason.ABORT) is b
    assert s.finish(b.request_id, FinishReason.ABORT) is None
    assert_idle(s)


def test_abort_during_step_discards_its_result() -> None:
    s = make()
    a = req(8)
    s.add(a)
    out = s.schedule()
    s.finish(a.request_id, FinishReason.ABORT)
    assert s.update(out, {a.request_id: SampledToken(5)}) == []
    assert a.output_token_ids == []


def test_requests_that_can_never_fit_are_rejected() -> None:
    s = make(num_blocks=4)
    with pytest.raises(RequestTooLongError):
        s.add(req(200, max_tokens=100))  # over max_model_len
    with pytest.raises(RequestTooLongError):
        s.add(req(20, max_tokens=4))  # more blocks than the pool has


def test_long_prompt_chunks_leave_room_for_prompts_queued_behind_it() -> None:
    s = make(budget=64, chunk_cap=16)
    long, short = req(40, max_tokens=2), req(5, max_tokens=2, first=60)
    s.add(long)
    s.add(short)
    out = run_step(s)
    # the long prompt takes one capped chunk; the short one is computed in the same step
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == [(long, 16), (short, 5)]
    assert short.output_token_ids == [100] and not long.output_token_ids
    out = run_step(s)
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == [(long, 16), (short, 1)]
    out = run_step(s)
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == [(long, 8)]
    assert long.output_token_ids == [100]
    while s.has_unfinished():
        run_step(s)
    assert_idle(s)


def test_a_prompt_alone_takes_larger_chunks_until_another_arrives() -> None:
    """Alone in the engine, a prompt's chunk is ALONE_CHUNK_FACTOR x the cap (nothing
    waits behind it); once another request is here, the cap holds again."""
    s = make(budget=256, chunk_cap=16)
    long = req(150, max_tokens=2)
    s.add(long)
    assert [x.num_new_tokens for x in run_step(s).scheduled] == [16 * ALONE_CHUNK_FACTOR]
    short = req(5, max_tokens=2, first=60)
    s.add(short)
    out = run_step(s)
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == [(long, 16), (short, 5)]
    while s.has_unfinished():
        run_step(s)
    assert_idle(s)


def test_shortest_first_computes_one_prompt_per_step_in_turn() -> None:
    """A prefill instance's policy: prompts that arrive together get their first tokens
    one after another (the first after its own compute), not all at the end."""
    s = make(budget=256, chunk_cap=16, shortest_first=True)
    prompts = [req(30, max_tokens=1, first=10 * (i + 1)) for i in range(3)]
    for p in prompts:
        s.add(p)
    firsts = []
    step = 0
    while s.has_unfinished():
        out = run_step(s)
        step += 1
        assert len(out.scheduled) <= 1
        firsts += [(x.request, step) for x in out.scheduled if x.request.output_token_ids]
    # each alone in its step: whole (30 <= 16 x ALONE_CHUNK_FACTOR), in arrival order
    assert firsts == [(prompts[0], 1), (prompts[1], 2), (prompts[2], 3)]
    assert_idle(s)


def test_shortest_first_lets_a_short_prompt_past_a_long_one() -> None:
    """A short prompt arriving while a long one is computed goes next; the long one
    goes on after it, from where it was."""
    s = make(budget=256, chunk_cap=8, shortest_first=True)
    long = req(100, max_tokens=1)
    s.add(long)
    assert [(x.request, x.num_new_tokens) for x in run_step(s).scheduled] == [(long, 32)]
    short = req(5, max_tokens=1, first=60)
    s.add(short)
    assert [(x.request, x.num_new_tokens) for x in run_step(s).scheduled] == [(short, 5)]
    assert short.output_token_ids == [100] and not long.output_token_ids
    out = run_step(s)
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == [(long, 32)]
    assert long.num_computed_tokens == 64
    while s.has_unfinished():
        run_step(s)
    assert long.output_token_ids == [100]
    assert_idle(s)


def test_chunk_cap_needs_chunked_prefill() -> None:
    s = make(budget=64, chunk_cap=16, chunked=False)
    long = req(40)
    s.add(long)
    assert [x.num_new_tokens for x in run_step(s).scheduled] == [40]


# -- KV from outside, through the connector ---------------------------------------------


def test_in_step_load_covers_whole_blocks_after_the_local_prefix() -> None:
    fake = FakeConnector()
    s = make(connector=fake)
    a = req(8, max_tokens=1)
    s.add(a)
    run_step(s)  # a's two blocks are now cached locally
    b = req(22, max_tokens=2)  # shares a's 2 blocks; 3 more can be loaded
    fake.offer(b, 20)
    s.add(b)
    out = run_step(s)
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == [(b, 2)]
    (load,) = fake.started
    assert load.first_block == 2 and load.slots == b.slots[2:5]
    assert b.cache_hit.local_tokens == 8 and b.cache_hit.external_tokens == 12
    assert b.num_cached_tokens == 20 and b.output_token_ids == [100]
    assert b.num_cached_blocks == 5  # loaded blocks are findable here from now on


def test_in_step_load_never_covers_the_last_token() -> None:
    fake = FakeConnector()
    s = make(connector=fake)
    r = req(12, max_tokens=1)
    fake.offer(r, 12)  # all three blocks are outside; the last must be computed
    s.add(r)
    out = run_step(s)
    assert out.scheduled[0].num_new_tokens == 4
    assert len(fake.started[0].slots) == 2


def test_failed_in_step_load_recomputes_with_identical_bookkeeping() -> None:
    fake = FakeConnector()
    s = make(connector=fake)
    r = req(21, max_tokens=2)
    fake.offer(r, 16)
    fake.fail_in_step.add(r.request_id)
    s.add(r)
    out = run_step(s)
    assert out.scheduled[0].num_new_tokens == 5
    # the step's sample is discarded and the request starts over without loading
    assert r.output_token_ids == [] and r.status is RequestStatus.WAITING
    assert not r.load_external and r.num_cached_tokens == 0 and not r.slots
    out = run_step(s)
    assert out.scheduled[0].num_new_tokens == 21 and len(fake.started) == 1
    while s.has_unfinished():
        run_step(s)
    assert r.output_token_ids == [100, 100]
    assert_idle(s)


def test_asynchronous_load_waits_then_computes_only_the_rest() -> None:
    fake = FakeConnector()
    s = make(connector=fake)
    r = req(10, max_tokens=2)
    fake.offer(r, 8, asynchronous=True)
    s.add(r)
    out = run_step(s)
    assert out.is_empty and r.status is RequestStatus.WAITING_FOR_KV
    assert len(r.slots) == 2 and not s.queues.waiting and not s.queues.running
    fake.end_load(r.request_id)
    out = run_step(s)
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == [(r, 2)]
    while s.has_unfinished():
        run_step(s)
    assert r.output_token_ids == [100, 100]
    assert_idle(s)


def test_asynchronous_loads_leave_growth_room_for_running_requests() -> None:
    fake = FakeConnector()
    s = make(num_blocks=6, connector=fake)
    running = req(4, max_tokens=8)
    s.add(running)
    run_step(s)
    big = req(16, max_tokens=2, first=40)
    fake.offer(big, 16, asynchronous=True)
    s.add(big)
    run_step(s)  # 4 blocks would leave 1 free: the running request needs room to grow
    assert big.status is RequestStatus.WAITING and not fake.started


def prefilled_elsewhere(n_prompt: int, max_tokens: int) -> tuple[Scheduler, FakeConnector, Request]:
    """A request whose whole prompt is loaded asynchronously and whose first token
    arrives later, after its first scheduling step."""
    fake = FakeConnector()
    s = make(connector=fake)
    r = req(n_prompt, max_tokens=max_tokens)
    fake.offer(r, n_prompt, asynchronous=True)
    r.awaiting_first_token = True
    s.add(r)
    run_step(s)
    return s, fake, r


def test_prefilled_elsewhere_loads_and_decodes_from_the_supplied_first_token() -> None:
    s, fake, r = prefilled_elsewhere(10, max_tokens=3)  # the partial tail is loaded too
    assert r.status is RequestStatus.WAITING_FOR_KV and len(r.slots) == 3
    fake.end_load(r.request_id)
    run_step(s)
    assert r.request_id in s.queues.parked  # loaded, but nothing to compute without the token
    s.supply_first_token(r.request_id, SampledToken(50))
    out = run_step(s, 60)
    (only,) = out.scheduled
    assert only.request is r and only.num_new_tokens == 1
    run_step(s, 61)
    assert r.output_token_ids == [50, 60, 61] and r.finish_reason is FinishReason.LENGTH
    assert_idle(s)


def test_first_token_before_the_load_ends_and_its_refusals() -> None:
    s, fake, r = prefilled_elsewhere(6, max_tokens=3)
    s.supply_first_token(r.request_id, SampledToken(50))
    with pytest.raises(InvalidRequestError, match="already"):
        s.supply_first_token(r.request_id, SampledToken(51))
    fake.end_load(r.request_id)
    assert run_step(s).scheduled[0].request is r
    eos = req(3)
    eos.awaiting_first_token = True
    s.add(eos)
    with pytest.raises(InvalidRequestError, match="ends"):
        s.supply_first_token(eos.request_id, SampledToken(EOS))
    with pytest.raises(InvalidRequestError, match="no request"):
        s.supply_first_token(RequestId("nobody"), SampledToken(1))


def test_failed_asynchronous_load_recomputes_the_prompt_but_not_the_first_token() -> None:
    s, fake, r = prefilled_elsewhere(10, max_tokens=2)
    fake.end_load(r.request_id, ok=False)
    run_step(s)
    assert r.request_id in s.queues.parked and not r.slots  # slots freed, nothing computed
    s.supply_first_token(r.request_id, SampledToken(50))
    out = run_step(s, 60)
    # the prompt and the first token are computed here; the token after is sampled
    assert out.scheduled[0].num_new_tokens == 11
    assert r.output_token_ids == [50, 60] and r.is_finished
    assert_idle(s)


def test_finished_request_keeps_its_slots_until_the_connector_lets_go() -> None:
    fake = FakeConnector()
    s = make(connector=fake)
    r = req(8, max_tokens=1)
    fake.hold_on_finish.add(r.request_id)
    s.add(r)
    run_step(s)
    assert r.is_finished and r.request_id in s.queues.releasing and len(r.slots) == 2
    fake.release(r.request_id)
    run_step(s)
    assert_idle(s)


def test_abort_during_an_asynchronous_load_frees_slots_once_released() -> None:
    s, fake, r = prefilled_elsewhere(8, max_tokens=2)
    assert s.finish(r.request_id, FinishReason.ABORT) is r
    assert r.request_id in s.queues.releasing and s.kv.num_free == s.kv.num_slots - 2
    fake.release(r.request_id)
    run_step(s)
    assert_idle(s)


def test_a_prompt_sharing_a_prefix_being_computed_waits_to_reuse_it() -> None:
    """In-batch prefix caching: the second request does not compute a copy of the blocks
    the first is computing; it is passed over (not blocking the queue) until they are
    cached, then reuses them."""
    s = make(budget=64, chunk_cap=8)
    first, twin, other = req(24, max_tokens=1), req(30, max_tokens=1), req(6, first=90)
    for r in (first, twin, other):
        s.add(r)
    out = run_step(s)
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == [(first, 8), (other, 6)]
    assert list(s.queues.waiting) == [twin]  # still first in line
    run_step(s)  # first's second chunk: twin's next block is being computed again
    run_step(s)  # first's last chunk
    assert list(s.queues.waiting) == [twin] and first.is_finished
    out = run_step(s)
    assert (twin, 30 - 24) in [(x.request, x.num_new_tokens) for x in out.scheduled]
    assert twin.num_cached_tokens == 24
    while s.has_unfinished():
        run_step(s)
    assert_idle(s)


def test_a_lone_prompts_chunk_grows_with_the_threads_its_steps_compute_on() -> None:
    """A lone prompt's chunk is ALONE_CHUNK_FACTOR x the cap for each compute thread
    (its step lasts about as long on any count); with another request here, the cap
    holds whatever the count."""
    s = make(budget=256, chunk_cap=8)
    long = req(200, max_tokens=2)
    s.add(long)
    s.set_threads(2)
    assert [x.num_new_tokens for x in run_step(s).scheduled] == [8 * ALONE_CHUNK_FACTOR * 2]
    s.set_threads(1)
    assert [x.num_new_tokens for x in run_step(s).scheduled] == [8 * ALONE_CHUNK_FACTOR]
    s.set_threads(2)
    short = req(5, max_tokens=2, first=60)
    s.add(short)
    out = run_step(s)
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == [(long, 8), (short, 5)]
    while s.has_unfinished():
        run_step(s)
    assert_idle(s)
