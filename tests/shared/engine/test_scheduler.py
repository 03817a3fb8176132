"""Scheduler logic with a real BlockPool and BlockHasher, no model."""

from __future__ import annotations

import itertools

import pytest

from shared.config import SchedulerConfig
from shared.engine.request import FinishReason, Request, RequestId, RequestStatus, SampledToken
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerOutput
from shared.errors import RequestTooLongError
from shared.kv.block_hash import BlockHasher
from shared.kv.block_pool import BlockPool

EOS = 2
_ids = itertools.count()


def make(
    num_blocks: int = 64,
    budget: int = 64,
    max_seqs: int = 8,
    block_size: int = 4,
    chunked: bool = True,
    chunk_cap: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=chunk_cap,
        ),
        BlockPool(num_blocks),
        BlockHasher(namespace="test", block_size=block_size),
        max_model_len=256,
        eos_token_ids=(EOS,),
    )


def req(n_prompt: int, max_tokens: int = 4, first: int = 10) -> Request:
    return Request(
        request_id=RequestId(f"r{next(_ids)}"),
        prompt_token_ids=list(range(first, first + n_prompt)),
        params=SamplingParams(max_tokens=max_tokens, temperature=0),
        seed=0,
        arrival=0.0,
    )


def run_step(s: Scheduler, token: int = 100) -> SchedulerOutput:
    """Schedule and pretend the model sampled ``token`` for every sampling request."""
    out = s.schedule()
    s.update(out, {x.request.request_id: SampledToken(token) for x in out.scheduled if x.samples})
    return out


def assert_idle(s: Scheduler) -> None:
    """Nothing queued or running, and every block back in the pool."""
    assert not s.has_unfinished()
    assert s.pool.num_free == s.pool.num_blocks


def test_prefill_then_decode_then_length_finish() -> None:
    s = make()
    r = req(10, max_tokens=3)
    s.add(r)
    out = run_step(s)
    assert [(x.request, x.num_new_tokens) for x in out.scheduled] == [(r, 10)]
    assert r.num_computed_tokens == 10 and r.output_token_ids == [100]
    assert len(r.block_ids) == 3
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
    assert s.pool.num_free == 5


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


def prefilled(s: Scheduler, n_prompt: int, max_tokens: int = 4, first: int = 50) -> Request:
    """A request whose prompt KV arrived from elsewhere, in blocks it already owns."""
    r = req(n_prompt, max_tokens)
    r.output_token_ids = [first]
    r.block_ids = s.pool.allocate(-(-(n_prompt + 1) // s.block_size))
    s.add_prefilled(r)
    return r


def test_prefilled_request_decodes_from_its_first_token() -> None:
    s = make()
    r = prefilled(s, 10, max_tokens=3)
    out = s.schedule()
    (only,) = out.scheduled
    assert only.request is r and only.num_new_tokens == 1 and only.samples
    assert r.num_computed_tokens == 10  # the prompt was never recomputed here
    s.update(out, {r.request_id: SampledToken(60)})
    run_step(s, 61)
    assert r.output_token_ids == [50, 60, 61]
    assert r.finish_reason is FinishReason.LENGTH
    assert_idle(s)


def test_prefilled_requests_respect_max_num_seqs() -> None:
    s = make(max_seqs=2)
    rs = [prefilled(s, 5) for _ in range(3)]
    out = s.schedule()
    assert [x.request for x in out.scheduled] == rs[:2]
    assert rs[2] in s.prefilled


def test_prefilled_request_refuses_missing_blocks_or_a_finished_first_token() -> None:
    s = make()
    short = req(10)
    short.output_token_ids = [50]
    short.block_ids = s.pool.allocate(1)  # 10 tokens need 3 blocks of 4
    with pytest.raises(ValueError, match="blocks"):
        s.add_prefilled(short)
    eos = req(3)
    eos.output_token_ids = [EOS]
    eos.block_ids = s.pool.allocate(1)
    with pytest.raises(ValueError, match="ends"):
        s.add_prefilled(eos)


def test_aborting_a_prefilled_request_before_it_joins_frees_its_blocks() -> None:
    s = make(max_seqs=1)
    prefilled(s, 5)
    waiting = prefilled(s, 5)
    s.schedule()
    s.finish(waiting.request_id, FinishReason.ABORT)
    assert waiting not in s.prefilled and not waiting.block_ids


def test_long_prompt_chunks_leave_room_for_prompts_queued_behind_it() -> None:
    s = make(budget=64, chunk_cap=16)
    long, short = req(40, max_tokens=2), req(5, max_tokens=2)
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


def test_chunk_cap_needs_chunked_prefill() -> None:
    s = make(budget=64, chunk_cap=16, chunked=False)
    long = req(40)
    s.add(long)
    assert [x.num_new_tokens for x in run_step(s).scheduled] == [40]
