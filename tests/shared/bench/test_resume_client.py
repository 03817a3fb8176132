"""The reference client for resumable streams against a fake server (an httpx mock
transport named as such): a stream that breaks part way is reattached with
Last-Event-ID, through 503s while no gateway answers, and read to its end with every
token once; a stream that cannot be resumed in time ends with a clear error."""

from __future__ import annotations

import json

import httpx

from shared.bench.chaos import ChaosRequest
from shared.bench.resume_client import resumable_stream

REQ = ChaosRequest(prompt=[1, 2, 3], max_tokens=6, seed=None)


def sse(seqs: range, done: bool) -> bytes:
    out = [
        f"id: {i}\ndata: {json.dumps({'id': 'cmpl-1', 'choices': [{'token_ids': [100 + i]}]})}\n\n"
        for i in seqs
    ]
    if done:
        out.append(f"id: {seqs.stop}\ndata: [DONE]\n\n")
    return "".join(out).encode()


class FakeGateways:
    """Event 0-2 on the first connection, which then drops; reattaching gets a 503
    (``unavailable`` times), then the events after the client's Last-Event-ID."""

    def __init__(self, unavailable: int):
        self.unavailable = unavailable
        self.cursors: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            body = json.loads(request.content)
            assert body["stream_options"] == {"resumable": True}
            return httpx.Response(
                200, headers={"X-Baton-Gateway": "gw-a"}, content=sse(range(3), False)
            )
        assert request.url.path == "/v1/completions/cmpl-1/stream"
        if self.unavailable:
            self.unavailable -= 1
            return httpx.Response(503, json={"error": {"message": "no server"}})
        after = int(request.headers["Last-Event-ID"])
        self.cursors.append(request.headers["Last-Event-ID"])
        return httpx.Response(200, content=sse(range(after + 1, 6), True))


async def test_a_broken_stream_is_reattached_after_its_last_event_and_read_to_its_end() -> None:
    server = FakeGateways(unavailable=2)
    async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
        out = await resumable_stream(http, "http://front", "m", REQ)
    assert out.error is None
    assert out.tokens == [100, 101, 102, 103, 104, 105]  # none missing, none twice
    assert out.owner == "gw-a" and out.response_id == "cmpl-1"
    assert server.cursors == ["2"]  # after the 503s, from the last event read
    assert len(out.gaps) == 1 and out.gaps[0] > 0


async def test_a_stream_that_cannot_be_resumed_in_time_ends_with_an_error() -> None:
    server = FakeGateways(unavailable=10_000)
    async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
        out = await resumable_stream(http, "http://front", "m", REQ, reconnect_s=0.3)
    assert out.error is not None and "could not resume" in out.error
    assert out.tokens == [100, 101, 102]
