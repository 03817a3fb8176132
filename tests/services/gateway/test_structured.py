"""Structured outputs and tool calls through the real cluster (prefill, two decode
instances, the KV store, Redis, the gateway; a supervisor restarts what dies) and the
official SDK: outputs validate, tokens equal the in-process engine's, a decode killed
in the middle of a JSON output resumes token-exact, bad constraints are 400s."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel

from services.prefill.prefiller import PREFILL_CHUNK_TOKENS
from shared.bench.chaos import ChaosRequest, Supervised, broken, reference, settle, with_fault
from shared.bench.scrape import metric_sum
from shared.engine.constraint import Constraint
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory
from tests.services.conftest import MODEL, Cluster, start_cluster

ITEM = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genres": {
            "type": "array",
            "items": {"enum": ["drama", "comedy", "thriller", "documentary"]},
            "maxItems": 3,
        },
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
    },
    "required": ["title", "year", "genres"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


class Person(BaseModel):
    name: str
    age: int
    city: str


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    local = start_cluster(tmp_path_factory.mktemp("structured"), prefill=1, decode=2)
    sup = Supervised(local)
    try:
        yield sup
    finally:
        sup.close()
        local.stop()


@pytest.fixture(scope="module")
def client(supervised: Supervised) -> OpenAI:
    return OpenAI(base_url=supervised.local.gateway_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> Engine:
    return make_engine(
        enable_prefix_caching=False, long_prefill_token_threshold=PREFILL_CHUNK_TOKENS
    )


def ask(text: str) -> Any:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("seed", [None, 7])
def test_the_sdk_parses_a_pydantic_model(client: OpenAI, seed: int | None) -> None:
    r = client.beta.chat.completions.parse(
        model=MODEL, messages=ask("Describe a person who lives in Rome."), response_format=Person,
        temperature=0 if seed is None else 0.8, seed=seed, max_tokens=80,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Person)


def test_json_schema_outputs_equal_the_engines_tokens(client: OpenAI, engine: Engine) -> None:
    prompt = engine.tokenizer.encode_chat(ask("Give me a film as JSON."))
    for seed in (None, 3, 11):
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=90, temperature=0 if seed is None else 0.9,
            seed=seed, extra_body={"structured_outputs": {"json": ITEM}, "return_token_ids": True},
        )  # fmt: skip
        got = r.choices[0].model_extra["token_ids"]  # type: ignore[index]
        params = SamplingParams(
            max_tokens=90, temperature=0 if seed is None else 0.9, seed=seed,
            constraint=Constraint.json_schema(ITEM),
        )  # fmt: skip
        done = engine.generate([prompt], params)[0]
        assert got == done.token_ids
        jsonschema.validate(json.loads(r.choices[0].text), ITEM)


@pytest.mark.parametrize("max_tokens", [24, 50])
def test_a_json_object_cut_by_max_tokens_still_parses(
    client: OpenAI, engine: Engine, max_tokens: int
) -> None:
    """The model repeats array items past any budget: prefill, planning for the whole
    budget, and decode close the object in time, the engine's tokens exactly."""
    prompt = engine.tokenizer.encode_chat(ask("Describe a city as a JSON object."))
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"structured_outputs": {"json_object": True}, "return_token_ids": True},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "length"
    assert isinstance(json.loads(r.choices[0].text), dict)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, constraint=Constraint.json_object()
    )
    assert r.choices[0].model_extra["token_ids"] == engine.generate([prompt], params)[0].token_ids  # type: ignore[index]


def test_json_object_regex_and_choice(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ask("Give the name and age of a person as a JSON object."),
        response_format={"type": "json_object"}, temperature=0, max_tokens=60,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    r = client.chat.completions.create(
        model=MODEL, messages=ask("Is the sky blue?"), temperature=0, max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert r.choices[0].message.content in ("yes", "no")
    done = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    )  # fmt: skip
    assert len(done.choices[0].text) == 8 and done.choices[0].text[3] == "-"


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_calls_streamed_and_not(client: OpenAI, choice: object) -> None:
    kw = {
        "model": MODEL, "messages": ask("What time is it in Tokyo, and the weather there?"),
        "tools": [WEATHER, TIME], "tool_choice": choice, "temperature": 0, "max_tokens": 60,
        "parallel_tool_calls": False,
    }  # fmt: skip
    r = client.chat.completions.create(**kw)
    whole = r.choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    if isinstance(choice, dict):
        assert [name for name, _ in calls] == ["get_time"]
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for name, args in calls:
        jsonschema.validate(args, tools[name])
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == calls[0][0]
    assert len(deltas) > 2  # the arguments came in pieces
    streamed = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    assert json.loads(streamed) == calls[0][1]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tools_give_content_or_calls(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ask("Say hello."), tools=[WEATHER], temperature=0, max_tokens=30,
    )  # fmt: skip
    choice = r.choices[0]
    assert (choice.message.content or choice.message.tool_calls) is not None
    assert choice.finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strang"}},
                }
            },
            "strang",
        ),
        (  # a keyword the grammar engine does not implement
            {"structured_outputs": {"json": {"type": "object", "dependentSchemas": {}}}},
            "dependentSchemas",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
        ({"structured_outputs": {"grammar": "start: nothing_here"}}, "nothing_here"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "nope",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "not both",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_problem(
    supervised: Supervised, extra: dict[str, object], needle: str
) -> None:
    body = {"model": MODEL, "messages": ask("hi"), "max_tokens": 5, **extra}
    r = httpx.post(supervised.local.gateway_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_a_decode_killed_in_the_middle_of_json_resumes_token_exact(
    supervised: Supervised, engine: Engine
) -> None:
    local = supervised.local
    rng = random.Random(5)
    reqs = []
    for i in range(4):
        prompt = engine.tokenizer.encode_chat(ask(f"Film number {i}, as JSON."))
        seed = None if i % 2 == 0 else rng.randrange(1 << 30)
        reqs.append(ChaosRequest([*prompt, rng.randrange(1000, 9000)], 96, seed, json_schema=ITEM))
    settle(local)
    run = asyncio.run(with_fault(local, MODEL, reqs, "kill", after_tokens=12))
    assert broken(run.results, reference(engine, reqs, batch=1)) == []
    for r in run.results:
        text = engine.tokenizer.decode(r.tokens)
        jsonschema.validate(json.loads(text), ITEM)


def test_bad_requests_compute_nothing(supervised: Supervised) -> None:
    local = supervised.local

    def steps() -> float:
        return sum(
            metric_sum(f"http://127.0.0.1:{spec.http_port}", "baton_engine_step_seconds_count")
            for spec in local.specs
            if spec.role in ("prefill", "decode")
        )

    before = steps()
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    for _ in range(3):
        r = httpx.post(
            local.gateway_url + "/v1/chat/completions", timeout=30,
            json={"model": MODEL, "messages": ask("hi"), "max_tokens": 5, "response_format": bad},
        )  # fmt: skip
        assert r.status_code == 400
    assert steps() == before
    for role in ("prefill", "decode"):
        assert all(s["in_flight"] == 0 for s in Cluster(local, local.gateway_url).stats(role))
