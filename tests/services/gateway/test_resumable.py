"""Resumable responses through a real cluster with two gateways (Redis, a KV store, a
prefill and a decode instance, API keys on): a resumable stream is reattached here or
at the other gateway with exactly the events not yet seen, the Responses API works
through the official SDK (create, stream, background, retrieve, resume with
``starting_after``, cancel, delete), bad cursors and ids get clear errors, and when
the gateway producing a stream is SIGKILLed, the other continues it from the log,
token for token what the in-process engine computes (greedy and seeded)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis as redis_client
from openai import OpenAI

from shared.cluster.keys import Keys
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.launcher import LocalCluster
from tests.conftest import EngineFactory
from tests.services.conftest import MODEL, serving_reference, start_cluster

KEYS = ("key-one", "key-two")
MAX_TOKENS = 48


@dataclass
class TwoGateways:
    local: LocalCluster
    a: str  # gateway-0
    b: str  # gateway-1
    front: str  # the balancer (HAProxy) in front of both


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoGateways]:
    local = start_cluster(
        tmp_path_factory.mktemp("resumable"), prefill=1, decode=1, gateways=2,
        BATON_GATEWAY_API_KEYS=",".join(KEYS), BATON_GATEWAY_RESPONSE_LEASE_S="1.0",
    )  # fmt: skip
    try:
        a, b = (s for s in local.specs if s.role == "gateway")
        yield TwoGateways(
            local, f"http://127.0.0.1:{a.http_port}", f"http://127.0.0.1:{b.http_port}",
            local.gateway_url,
        )  # fmt: skip
    finally:
        local.stop()


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> Engine:
    return serving_reference(make_engine, enable_prefix_caching=False)


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def body(prompt: list[int], seed: int | None, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0 if seed is None else 0.8,
        "seed": seed,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"resumable": True, "include_usage": True},
    }


def expected(
    engine: Engine, prompt: list[int], seed: int | None, max_tokens: int = MAX_TOKENS
) -> list[int]:
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if seed is None else 0.8,
        seed=seed,
        ignore_eos=True,
    )
    return list(engine.generate([prompt], params)[0].token_ids)


@dataclass
class Event:
    seq: int | None
    data: str


def events(lines: Iterator[str]) -> Iterator[Event]:
    """SSE events (id and data) from a stream's lines."""
    seq: int | None = None
    data: list[str] = []
    for line in lines:
        if line.startswith("id: "):
            seq = int(line[4:])
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and data:
            yield Event(seq, "\n".join(data))
            seq, data = None, []


def tokens_of(evs: list[Event]) -> list[int]:
    out: list[int] = []
    for ev in evs:
        if ev.data != "[DONE]":
            for choice in json.loads(ev.data).get("choices", []):
                out += choice.get("token_ids") or []
    return out


def open_and_read(url: str, payload: dict[str, object], n: int) -> tuple[str, list[Event]]:
    """Starts a resumable stream, reads its first ``n`` events and goes away."""
    got: list[Event] = []
    with httpx.stream(
        "POST", url + "/v1/completions", json=payload, headers=auth(), timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for ev in events(r.iter_lines()):
            got.append(ev)
            if len(got) == n:
                break
    response_id = json.loads(got[0].data)["id"]
    return response_id, got


def reattach(url: str, response_id: str, headers: dict[str, str], query: str = "") -> list[Event]:
    path = f"{url}/v1/completions/{response_id}/stream{query}"
    with httpx.stream("GET", path, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return list(events(r.iter_lines()))


@pytest.mark.parametrize("seed", [None, 1234])
def test_a_stream_reattached_at_either_gateway_goes_on_with_the_events_not_seen(
    gateways: TwoGateways, engine: Engine, seed: int | None
) -> None:
    prompt = list(range(100, 160))
    rid, first = open_and_read(gateways.a, body(prompt, seed), 10)
    assert [e.seq for e in first] == list(range(10))
    # Last-Event-ID wins over the query; the other gateway serves it from the log
    rest = reattach(gateways.b, rid, {**auth(), "Last-Event-ID": "9"}, "?starting_after=2")
    assert [e.seq for e in rest] == list(range(10, 10 + len(rest)))
    assert rest[-1].data == "[DONE]"
    assert tokens_of(first + rest) == expected(engine, prompt, seed)
    # the whole log again, from the query's cursor, at the first gateway
    again = reattach(gateways.a, rid, auth(), "?starting_after=-1")
    assert [e.data for e in again] == [e.data for e in first + rest]


def test_bad_cursors_and_ids_get_clear_errors_and_another_keys_response_is_not_found(
    gateways: TwoGateways,
) -> None:
    rid, _ = open_and_read(gateways.a, body(list(range(5, 40)), None), 3)
    url = f"{gateways.b}/v1/completions/{rid}/stream"
    assert httpx.get(url, headers=auth(KEYS[1])).status_code == 404  # never leaked
    assert (
        httpx.get(f"{gateways.b}/v1/completions/cmpl-nope/stream", headers=auth()).status_code
        == 404
    )
    assert (
        httpx.get(f"{gateways.b}/v1/chat/completions/{rid}/stream", headers=auth()).status_code
        == 404
    )
    past = httpx.get(url + "?starting_after=100000", headers=auth())
    assert past.status_code == 400 and past.json()["error"]["param"] == "starting_after"
    bad = httpx.get(url, headers={**auth(), "Last-Event-ID": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    refused = httpx.post(
        gateways.a + "/v1/completions",
        json={**body([1, 2, 3], None), "n": 2},
        headers=auth(),
    )
    assert refused.status_code == 400 and "n = 1" in refused.json()["error"]["message"]


def test_the_responses_api_through_the_official_sdk(gateways: TwoGateways) -> None:
    client = OpenAI(base_url=gateways.a + "/v1", api_key=KEYS[0], max_retries=0)
    other = OpenAI(base_url=gateways.b + "/v1", api_key=KEYS[0], max_retries=0)
    ask: Any = {
        "model": MODEL,
        "input": "Name three colours.",
        "max_output_tokens": 200,
        "temperature": 0,
    }
    whole = client.responses.create(**ask)
    assert whole.status == "completed" and whole.output_text  # ended by the model (EOS)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
        max_completion_tokens=200, temperature=0,
    )  # fmt: skip
    assert whole.output_text == chat.choices[0].message.content  # the same computation
    assert whole.usage is not None and chat.usage is not None
    assert whole.usage.output_tokens == chat.usage.completion_tokens

    streamed = list(client.responses.create(**ask, stream=True))
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    assert streamed[0].type == "response.created" and streamed[-1].type.startswith("response.")
    text = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    assert text == whole.output_text
    # background and streamed: the events as they are made (resumable like any stored one)
    live = list(client.responses.create(**ask, background=True, stream=True))
    assert [e.sequence_number for e in live] == list(range(len(live)))
    assert live[0].type == "response.created" and live[0].response.background
    assert "".join(e.delta for e in live if e.type == "response.output_text.delta") == text

    started = client.responses.create(**ask, background=True)
    assert started.status == "in_progress" and started.background
    deadline = time.monotonic() + 60
    polled = other.responses.retrieve(started.id)  # any gateway answers a poll
    while polled.status == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.1)
        polled = other.responses.retrieve(started.id)
    assert polled.status == "completed" and polled.output_text == whole.output_text
    with other.responses.stream(response_id=started.id, starting_after=5) as resumed:
        later = list(resumed)
        final = resumed.get_final_response()
    assert [e.sequence_number for e in later] == list(range(6, 6 + len(later)))
    assert final.output_text == whole.output_text
    raw = list(other.responses.retrieve(started.id, stream=True, starting_after=3))
    assert raw[0].sequence_number == 4

    long_one = client.responses.create(**{**ask, "max_output_tokens": 400}, background=True)
    cancelled = other.responses.cancel(long_one.id)
    assert cancelled.status == "cancelled"
    assert client.responses.cancel(long_one.id).status == "cancelled"  # idempotent
    client.responses.delete(long_one.id)
    with pytest.raises(Exception, match=r"404|not found|No response"):
        client.responses.retrieve(long_one.id)
    stranger = OpenAI(base_url=gateways.b + "/v1", api_key=KEYS[1], max_retries=0)
    with pytest.raises(Exception, match=r"404|No response"):
        stranger.responses.retrieve(started.id)


def test_responses_api_refusals_name_the_parameter(gateways: TwoGateways) -> None:
    url = gateways.a + "/v1/responses"
    for extra, param in (
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"background": True, "store": False}, None),
        ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ):
        r = httpx.post(url, json={"model": MODEL, "input": "hi", **extra}, headers=auth())
        assert r.status_code == 400, (extra, r.text)
        if param is not None:
            assert r.json()["error"]["param"] == param, r.text
    assert httpx.get(gateways.a + "/v1/responses/resp_nope", headers=auth()).status_code == 404


def test_with_redis_down_a_resumable_stream_is_served_as_an_ordinary_one(
    gateways: TwoGateways, engine: Engine
) -> None:
    redis = gateways.local.redis
    assert redis.proc is not None
    redis.proc.kill()
    redis.proc.wait()
    try:
        prompt = list(range(400, 440))
        with httpx.stream(
            "POST",
            gateways.a + "/v1/completions",
            json=body(prompt, None),
            headers=auth(),
            timeout=120,
        ) as r:
            assert r.status_code == 200, r.read()
            lines = list(r.iter_lines())
        assert lines[0] == "event: baton.resumable" and lines[1] == 'data: {"resumable": false}'
        got = list(events(iter(lines)))
        assert all(e.seq is None for e in got)  # not numbered: nothing to reattach to
        assert got[-1].data == "[DONE]"
        assert tokens_of(got[1:]) == expected(engine, prompt, None)
    finally:
        redis.start()
    # the instances re-register with the empty Redis (within a heartbeat or two)
    client = redis_client.Redis.from_url(redis.url)
    keys = Keys(gateways.local.specs[0].env.get("BATON_REDIS_PREFIX", "baton"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(client.keys(keys.member(role, "*")) for role in ("prefill", "decode")):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the instances did not re-register after Redis came back")
    client.close()


def test_streams_whose_gateway_was_killed_are_continued_through_the_balancer(
    gateways: TwoGateways, engine: Engine
) -> None:
    """Last in this module: two resumable streams (greedy and seeded) opened through the
    balancer; the gateway producing them is SIGKILLed mid-way; the client reconnects
    through the balancer with Last-Event-ID, the balancer sends it to the survivor,
    which continues each stream from the log once it finds the dead one gone, with
    the tokens the in-process engine computes, and the usage the first gateway saw
    (the prompts' KV was cached by an earlier request: the take-over reports it)."""
    streams = []
    owners = set()
    for seed, prompt in ((None, list(range(200, 290))), (99, list(range(300, 350)))):
        warm = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        assert httpx.post(gateways.front + "/v1/completions", json=warm, headers=auth()).is_success
        payload = body(prompt, seed, max_tokens=160)
        got: list[Event] = []
        with httpx.stream(
            "POST", gateways.front + "/v1/completions", json=payload, headers=auth(), timeout=120
        ) as r:
            assert r.status_code == 200, r.read()
            owners.add(r.headers["X-Baton-Gateway"])
            for ev in events(r.iter_lines()):
                got.append(ev)
                if len(got) == 8:
                    break
        streams.append((json.loads(got[0].data)["id"], got, prompt, seed))
    ids = {
        httpx.get(f"http://127.0.0.1:{s.http_port}/ready").json()["gateway"]: s
        for s in gateways.local.specs
        if s.role == "gateway"
    }
    for owner in owners:  # round robin: maybe both; keep one alive
        pid = gateways.local.pid_of(ids[owner])
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # mid-stream, the owner dies
        break
    for rid, got, prompt, seed in streams:
        t0 = time.monotonic()
        rest = reattach(gateways.front, rid, {**auth(), "Last-Event-ID": str(got[-1].seq)})
        assert time.monotonic() - t0 < 60
        assert [e.seq for e in rest] == list(range(8, 8 + len(rest)))
        assert rest[-1].data == "[DONE]"
        assert tokens_of(got + rest) == expected(engine, prompt, seed, max_tokens=160)
        usage = next(
            json.loads(e.data)["usage"]
            for e in rest
            if e.data != "[DONE]" and json.loads(e.data).get("usage")
        )
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 32, usage
