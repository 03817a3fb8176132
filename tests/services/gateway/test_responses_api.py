"""The Responses API's pure parts: the request's translation into chat, the event
sequence (numbered, deterministic: a gateway continuing a response rebuilds the
same events), and a poll's view of a logged response."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError

from services.gateway.responses_api import ResponseEvents, ResponsesRequest, fold, response_events
from services.gateway.resumable import Emitted


def request(**extra: object) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **extra})


def test_the_request_becomes_the_chat_request_that_computes_it() -> None:
    body = request(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Rules."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        ],
        max_output_tokens=7,
        seed=3,
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    )
    chat = body.chat_body()
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Hi"},
    ]
    assert chat["max_completion_tokens"] == 7 and chat["seed"] == 3
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    }
    assert "response_format" not in request(text={"format": {"type": "text"}}).chat_body()


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "web_search"}]},
        {"previous_response_id": "resp_1"},
        {"reasoning": {"effort": "high"}},
        {"background": True, "store": False},
        {"text": {"format": {"type": "json_schema"}}},
        {"unknown": 1},
    ],
)
def test_what_baton_does_not_do_is_refused(extra: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        request(**extra)
    request(tools=[], tool_choice="auto", include=[], truncation="disabled")  # neutral


async def steps(
    items: list[tuple[str, int, str | None]],
) -> AsyncIterator[tuple[str, int, str | None]]:
    for item in items:
        yield item


async def sequence(items: list[tuple[str, int, str | None]]) -> list[Emitted]:
    ev = ResponseEvents(request(max_output_tokens=3), "resp_abc", 1700000000, 5)
    return [e async for e in response_events(ev, steps(items))]


def data(e: Emitted) -> dict[str, object]:
    kind, payload = e.data.split("\n", 1)
    body = json.loads(payload.removeprefix("data: "))
    assert kind == f"event: {body['type']}"
    return body


async def test_events_are_numbered_carry_their_tokens_and_repeat_exactly() -> None:
    items = [("Hel", 11, None), ("", 12, None), ("lo", 13, "length")]
    first = await sequence(items)
    assert [data(e)["sequence_number"] for e in first] == list(range(len(first)))
    assert [data(e)["type"] for e in first] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    # a step with no text passes its token on to the next event that shows some
    assert [e.tokens for e in first[4:6]] == [(11,), (12, 13)]
    assert first[5].finish == "length" and first[-1].status == "incomplete"
    last = data(first[-1])["response"]
    assert isinstance(last, dict)
    assert last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert (
        last["usage"]["output_tokens"] == 3 and last["output"][0]["content"][0]["text"] == "Hello"
    )
    assert [e.data for e in await sequence(items)] == [e.data for e in first]  # deterministic


async def test_the_first_delta_carries_the_reused_prompt_tokens_for_a_take_over() -> None:
    """Logged with the first delta (the record keeps it): a gateway that takes the
    response over reports the usage its first owner saw, not its own replay's."""
    ev = ResponseEvents(request(max_output_tokens=3), "resp_abc", 1700000000, 5)

    async def cached_steps() -> AsyncIterator[tuple[str, int, str | None]]:
        ev.cached_tokens = 4  # known with the first token, as the handoff reports it
        for item in [("Hel", 11, None), ("lo", 13, "length")]:
            yield item

    out = [e async for e in response_events(ev, cached_steps())]
    deltas = [e for e in out if data(e)["type"] == "response.output_text.delta"]
    assert [e.cached_tokens for e in deltas] == [4, None]
    assert all(e.cached_tokens is None for e in out if e not in deltas)
    final = data(out[-1])["response"]
    assert isinstance(final, dict)
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 4}


async def test_a_poll_sees_the_text_so_far_then_the_final_response() -> None:
    events = [e.data for e in await sequence([("Hel", 11, None), ("lo", 13, "stop")])]
    partial = fold(events[:5])
    assert partial is not None and partial["status"] == "in_progress"
    assert partial["output"][0]["content"][0]["text"] == "Hel"
    done = fold(events)
    assert done is not None and done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "Hello"
    assert fold([]) is None


async def test_a_failed_generation_ends_with_response_failed() -> None:
    async def broken() -> AsyncIterator[tuple[str, int, str | None]]:
        yield "a", 1, None
        raise RuntimeError("decode died")

    ev = ResponseEvents(request(), "resp_x", 1, 2)
    out = [e async for e in response_events(ev, broken())]
    assert out[-1].status == "failed"
    body = data(out[-1])["response"]
    assert isinstance(body, dict) and body["status"] == "failed" and body["error"]["message"]
