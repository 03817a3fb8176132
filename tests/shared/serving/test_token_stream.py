"""A decode stream's events while its request waits: ``waiting`` only while the engine
keeps stepping (a queued or preempted request), nothing from a stuck engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.engine.engine_loop import Output
from shared.serving import token_stream
from shared.serving.protocol import WaitingEvent
from shared.serving.token_stream import TokenStream


def test_waiting_events_follow_engine_steps_not_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_stream, "WAITING_EVENT_S", 0.02)
    steps = [0]

    async def run() -> list[object]:
        outputs: asyncio.Queue[Output] = asyncio.Queue()
        events = TokenStream().events(outputs, steps=lambda: steps[0])
        first = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.05)  # a stuck engine (no step): nothing yet
        assert not first.done()
        steps[0] = 3  # the engine stepped (other requests ran) while this one waited
        got: list[object] = [await first]
        steps[0] = 4
        got.append(await anext(events))
        late = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.1)
        assert not late.done()  # stuck again: silent
        outputs.put_nowait(None)  # the engine stopped
        with pytest.raises(RuntimeError, match="engine stopped"):
            await late
        return got

    assert asyncio.run(run()) == [WaitingEvent(steps=3), WaitingEvent(steps=4)]


def test_a_long_step_in_progress_keeps_the_stream_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that takes long (a long prompt chunk beside the stream) is progress: the
    keepalives go on while it runs, and stop once nothing runs and nothing steps."""
    monkeypatch.setattr(token_stream, "WAITING_EVENT_S", 0.02)
    busy = [True]

    async def run() -> int:
        outputs: asyncio.Queue[Output] = asyncio.Queue()
        events = TokenStream().events(outputs, steps=lambda: 5, working=lambda: busy[0])
        got = 0
        for _ in range(3):  # the step count never grows, the step goes on
            assert await asyncio.wait_for(anext(events), 1.0) == WaitingEvent(steps=5)
            got += 1
        busy[0] = False  # the engine thread stopped: silence
        late = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.1)
        assert not late.done()
        outputs.put_nowait(None)
        with pytest.raises(RuntimeError, match="engine stopped"):
            await late
        return got

    assert asyncio.run(run()) == 3


def test_without_a_step_count_a_stream_only_carries_tokens() -> None:
    async def run() -> float:
        outputs: asyncio.Queue[Output] = asyncio.Queue()
        events = TokenStream().events(outputs)
        asyncio.get_running_loop().call_later(0.1, outputs.put_nowait, None)
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match="engine stopped"):
            await anext(events)
        return time.perf_counter() - start

    assert asyncio.run(run()) >= 0.09  # it waited for the engine, sending nothing
