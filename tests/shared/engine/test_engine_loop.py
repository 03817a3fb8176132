"""The engine on its own thread, driven from asyncio (the services' way to run it)."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Any

import pytest
import torch

from shared.config import EngineConfig
from shared.engine.elastic_threads import ThreadGovernor
from shared.engine.engine import Engine
from shared.engine.engine_loop import (
    IDLE_AFTER_S,
    EngineLoop,
    LoopStats,
    next_output,
    on_passing_thread,
)
from shared.engine.sampling_params import SamplingParams
from shared.engine.step_pacer import StepPacer
from shared.model.loader import LoadedModel
from tests.conftest import EngineFactory
from tests.shared.engine.fake_cpu import FakeCpuSource


def test_the_recent_step_time_follows_the_last_steps_and_is_zero_when_idle() -> None:
    stats = LoopStats()
    assert stats.step_time(now=0.0) == 0.0
    stats.observe_step(0.04, end=10.0)
    assert stats.step_time(now=10.5) == pytest.approx(0.04)  # the first step sets it
    for i in range(20):
        stats.observe_step(0.1, end=11.0 + i * 0.1)
    assert stats.step_time(now=13.0) == pytest.approx(0.1, rel=0.01)
    stats.observe_step(0.02, end=14.0)
    assert 0.02 < stats.step_time(now=14.0) < 0.1  # one quick step moves it, not all the way
    assert stats.step_time(now=14.0 + IDLE_AFTER_S + 0.01) == 0.0
    assert stats.steps == 22 and stats.busy_s == pytest.approx(2.06)


def test_the_recent_prompt_rate_follows_the_steps_that_computed_tokens_and_stays_when_idle() -> (
    None
):
    stats = LoopStats()
    stats.observe_step(0.5, end=1.0, tokens=1000)
    assert stats.recent_tokens_s == pytest.approx(2000)
    for i in range(30):
        stats.observe_step(0.1, end=2.0 + i, tokens=100)
    assert stats.recent_tokens_s == pytest.approx(1000, rel=0.01)
    stats.observe_step(0.1, end=40.0)  # no token count: the rate is not moved
    assert stats.recent_tokens_s == pytest.approx(1000, rel=0.01)


async def test_outputs_arrive_in_order_and_match_a_plain_engine(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    prompts = [engine.tokenizer.encode(t) for t in ("Hello", "One two three four five six")]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = [c.token_ids for c in make_engine().generate(prompts, params)]
    loop = EngineLoop(engine)
    loop.start()
    try:
        queues = [loop.subscribe(f"r{i}") for i in range(len(prompts))]
        for i, p in enumerate(prompts):

            def add(e: Engine, p: list[int] = p, rid: str = f"r{i}") -> str:
                return e.add_request(p, params, request_id=rid)

            await loop.call(add)
        got = []
        for q in queues:
            tokens: list[int] = []
            while True:
                out = await asyncio.wait_for(next_output(q), 60)
                tokens += out.new_token_ids
                if out.finished:
                    break
            got.append(tokens)
        assert got == reference
        assert loop.stats.steps > 0
    finally:
        await loop.stop()


async def test_call_propagates_errors_and_the_loop_survives(make_engine: EngineFactory) -> None:
    loop = EngineLoop(make_engine())
    loop.start()
    try:
        with pytest.raises(ValueError, match="boom"):
            await loop.call(lambda e: (_ for _ in ()).throw(ValueError("boom")))
        assert await loop.call(lambda e: e.kv.num_free) > 0
        assert loop.alive
    finally:
        await loop.stop()
    assert not loop.alive


async def test_engine_thread_can_be_pinned_apart_from_the_event_loop(
    make_engine: EngineFactory,
) -> None:
    mine = os.sched_getaffinity(0)
    cpu = min(mine)
    loop = EngineLoop(make_engine(), cpus=frozenset({cpu}))
    loop.start()
    try:
        engine_side = await loop.call(lambda e: os.sched_getaffinity(0))
    finally:
        await loop.stop()
    assert engine_side == {cpu}
    assert os.sched_getaffinity(0) == mine  # Linux affinity is per thread


async def test_a_governor_sets_each_steps_threads(make_engine: EngineFactory) -> None:
    """Steps run on the thread count the governor decides; the loop reports it."""
    source = FakeCpuSource(cpus=2)  # nothing else busy: the governor grants 2
    engine = make_engine()
    loop = EngineLoop(engine, threads=ThreadGovernor(source, 1, 2, clock=lambda: source.now))
    saved = torch.get_num_threads()
    loop.start()
    try:
        q = loop.subscribe("r")
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        await loop.call(lambda e: e.add_request([1, 2, 3], params, request_id="r"))
        while not (await asyncio.wait_for(next_output(q), 60)).finished:
            pass
        assert loop.stats.threads == 2
        assert await loop.call(lambda e: torch.get_num_threads()) == 2
    finally:
        await loop.stop()
        torch.set_num_threads(saved)


async def test_a_paced_loop_spaces_its_steps_and_keeps_the_tokens(
    make_engine: EngineFactory,
) -> None:
    """With a pacer (decode with a TPOT target and a busy neighbour), consecutive steps
    start at least the paced interval apart, commands still run meanwhile, and the
    tokens are those of an unpaced engine."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = [1, 2, 3, 4, 5]
    reference = make_engine().generate([prompt], params)[0].token_ids
    pacer = StepPacer(0.25, contended=lambda: True, margin=0.8)  # 200 ms apart
    engine = make_engine()
    # the property is when steps start; when their outputs reach this task also carries
    # the event loop's jitter and each step's own length, so the starts are recorded here
    starts: list[float] = []
    step = engine.step

    def recorded_step(**kwargs: Any) -> Any:
        starts.append(time.perf_counter())
        return step(**kwargs)

    engine.step = recorded_step  # type: ignore[method-assign]
    loop = EngineLoop(engine, pacer=pacer)
    loop.start()
    try:
        q = loop.subscribe("r")
        await loop.call(lambda e: e.add_request(prompt, params, request_id="r"))
        tokens: list[int] = []
        while True:
            out = await asyncio.wait_for(next_output(q), 60)
            tokens += out.new_token_ids
            if out.finished:
                break
            t0 = time.perf_counter()
            assert await loop.call(lambda e: e.has_unfinished())  # answered while it waits
            assert time.perf_counter() - t0 < 0.15
        assert tokens == reference
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        assert len(gaps) == len(reference) - 1 and min(gaps) >= pacer.interval_s - 0.005, gaps
        assert pacer.paced_steps >= len(gaps)
    finally:
        await loop.stop()


async def test_a_paced_loop_computes_a_prompt_queued_beside_its_streams_unpaced(
    make_engine: EngineFactory,
) -> None:
    """A prompt computed here (a mixed instance's lent prompt, a recompute) is never
    delayed by pacing: its chunks run back to back while a stream decodes beside it,
    and both get the tokens of an unpaced engine."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    stream_prompt, long_prompt = [1, 2, 3, 4, 5], list(range(10, 250))
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    reference = make_engine(max_num_batched_tokens=32).generate([long_prompt], short)[0]
    pacer = StepPacer(0.25, contended=lambda: True, margin=0.8)  # 200 ms apart
    loop = EngineLoop(make_engine(max_num_batched_tokens=32), pacer=pacer)
    loop.start()
    try:
        qa, qb = loop.subscribe("a"), loop.subscribe("b")
        await loop.call(lambda e: e.add_request(stream_prompt, params, request_id="a"))
        await asyncio.wait_for(next_output(qa), 60)  # the stream runs (and is paced)
        await asyncio.wait_for(next_output(qa), 60)
        assert pacer.paced_steps > 0

        def add_long(e: Engine) -> int:  # the count read between two steps, on their thread
            e.add_request(long_prompt, short, request_id="b")
            return pacer.paced_steps

        before = await loop.call(add_long)
        first = await asyncio.wait_for(next_output(qb), 60)
        # 240 tokens in chunks of at most 32 (less the stream's token): >= 8 steps, of
        # which none waited (the step that gave the prompt its first token may be paced
        # by the time its token arrives here: the stream alone runs on after it)
        assert pacer.paced_steps <= before + 1, (before, pacer.paced_steps)
        tokens = list(first.new_token_ids)
        while not first.finished:
            first = await asyncio.wait_for(next_output(qb), 60)
            tokens += first.new_token_ids
        assert tokens == reference.token_ids
    finally:
        await loop.stop()


async def test_a_prompt_added_during_a_paced_gap_starts_at_once(
    make_engine: EngineFactory,
) -> None:
    """A stream's paced gap (4 s here) holds back that stream's next step, not a prompt
    that arrives meanwhile: the prompt's first token comes long before the gap ends."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    pacer = StepPacer(5.0, contended=lambda: True, margin=0.8)
    loop = EngineLoop(make_engine(), pacer=pacer)
    loop.start()
    try:
        qa, qb = loop.subscribe("a"), loop.subscribe("b")
        await loop.call(lambda e: e.add_request([1, 2, 3, 4, 5], params, request_id="a"))
        await asyncio.wait_for(next_output(qa), 60)  # the gap starts as this step ends
        added = time.perf_counter()
        await loop.call(lambda e: e.add_request(list(range(10, 60)), params, request_id="b"))
        await asyncio.wait_for(next_output(qb), 60)
        assert time.perf_counter() - added < pacer.interval_s / 2
    finally:
        await loop.stop()


def test_step_time_is_split_by_the_thread_count_it_ran_on() -> None:
    stats = LoopStats()
    stats.step_started(2, now=1.0)
    stats.threads_changed(1, now=1.3)  # shrunk between two layers
    stats.step_ended(now=1.4)
    stats.threads_changed(2, now=5.0)  # between steps: no time counted
    stats.step_started(2, now=6.0)
    stats.step_ended(now=6.5)
    assert stats.thread_seconds == pytest.approx({2: 0.8, 1: 0.1})


async def test_the_engine_thread_runs_the_configured_thread_count(
    loaded_fp32: LoadedModel,
) -> None:
    """OpenMP's thread count is per thread: the engine thread sets the engine's own."""
    loop = EngineLoop(Engine(loaded_fp32, EngineConfig(num_threads=1)))
    loop.start()
    try:
        assert await loop.call(lambda e: torch.get_num_threads()) == 1
    finally:
        await loop.stop()


async def test_start_up_work_runs_on_a_thread_that_ends_with_it() -> None:
    """OpenMP keeps a worker pool per thread that ran a parallel region, for that
    thread's life: start-up work runs where its pool goes with it."""
    import threading

    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 7

    assert await on_passing_thread(work) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def fail() -> None:
        raise ValueError("no model")

    with pytest.raises(ValueError, match="no model"):
        await on_passing_thread(fail)
