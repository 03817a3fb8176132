"""OpenAI conformance through a real cluster: client request ids are echoed and never
used as keys, ``models.retrieve`` through the official SDK, every unsupported
parameter refused by name, the schema in ``/openapi.json``, and the parameters
users of vLLM rely on (``n``, ``logit_bias``, ``echo``) token-exact against the
in-process engine."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from services.gateway.completion import choice_seed
from services.gateway.openai_schema import ChatCompletion, Completion, ModelList
from shared.engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory
from tests.services.conftest import MODEL, Cluster, serving_reference

ODD_IDS = ["a/b", "../../x", "what?x=1", "frag#1", "enc%2Fpath", "x" * 300, "dup", "dup", "dup"]


def test_client_request_ids_are_echoed_never_used_as_keys(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 6, "ignore_eos": True}

    async def one(http: httpx.AsyncClient, client_id: str) -> httpx.Response:
        return await http.post("/v1/completions", json=body, headers={"X-Request-Id": client_id})

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
            return await asyncio.gather(*(one(http, i) for i in ODD_IDS))

    start = time.monotonic()
    responses = asyncio.run(run())
    assert time.monotonic() - start < 60
    internal = set()
    for client_id, r in zip(ODD_IDS, responses, strict=True):
        assert r.status_code == 200, (client_id, r.text)
        assert r.headers["x-request-id"] == client_id
        assert len(r.json()["choices"][0]["text"]) > 0
        internal.add(r.headers["x-baton-request-id"])
    assert len(internal) == len(responses)  # each request got its own id


def test_models_retrieve_through_the_sdk(cluster: Cluster) -> None:
    client = OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    try:
        model = client.models.retrieve(MODEL)
        assert model.id == MODEL and model.object == "model"
        assert [m.id for m in client.models.list()] == [MODEL]
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve("no-such-model")
        assert err.value.body == {
            "message": "The model 'no-such-model' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    finally:
        client.close()
    listed = ModelList.model_validate(httpx.get(f"{cluster.url}/v1/models", timeout=10).json())
    assert listed.data[0].dtype == ["float32"]  # the test cluster pins the reference's dtype


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools.0.function.name",
        ),
        ({"tool_choice": "auto"}, "tool_choice"),  # without tools
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"store": True}, "store"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"12": 500}}, "logit_bias.12"),
        ({"n": 17}, "n"),
        ({"stream_options": {"include_usage": True}}, None),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),  # no tool_call_id
    ],
)
def test_unsupported_parameters_are_refused_by_name(
    cluster: Cluster, extra: dict[str, Any], param: str | None
) -> None:
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json={**CHAT, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "Value error" not in error["message"]
    if param is not None:
        assert param.split(".")[0] in error["message"]


def test_neutral_values_of_unsupported_parameters_are_accepted(cluster: Cluster) -> None:
    neutral = {
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "k",
    }
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json={**CHAT, **neutral}, timeout=60)
    assert r.status_code == 200, r.text
    ChatCompletion.model_validate(r.json())


def test_openapi_describes_request_and_response_bodies(cluster: Cluster) -> None:
    doc = httpx.get(f"{cluster.url}/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]

    def resolve(ref: str) -> dict[str, Any]:
        return schemas[ref.rsplit("/", 1)[1]]

    for path, request, response in [
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletion"),
        ("/v1/completions", "CompletionRequest", "Completion"),
    ]:
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(request) and "model" in resolve(ref)["required"]
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith(response)
        assert "text/event-stream" in ok
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    assert "/v1/models/{model_id}" in doc["paths"]
    refs = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.add(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    assert all(r.rsplit("/", 1)[1] in schemas for r in refs)  # every reference resolves


def _stream_choices(raw: str) -> tuple[dict[int, list[int]], dict[int, str], dict[str, Any]]:
    tokens: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    usage: dict[str, Any] = {}
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            tokens.setdefault(c["index"], []).extend(c.get("token_ids") or [])
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    return tokens, finish, usage


def test_n_choices_logit_bias_and_echo_match_the_engine(
    cluster: Cluster, make_engine: EngineFactory
) -> None:
    engine = serving_reference(make_engine)
    tok = engine.tokenizer
    text = "Write a short line about the sea:"
    prompt = tok.encode(text)
    seed, n = 77, 3
    common = {"model": MODEL, "prompt": text, "max_tokens": 8, "return_token_ids": True}
    sampled = {**common, "n": n, "seed": seed, "temperature": 0.9}

    whole = httpx.post(f"{cluster.url}/v1/completions", json=sampled, timeout=120)
    assert whole.status_code == 200, whole.text
    body = Completion.model_validate(whole.json())
    assert [c.index for c in body.choices] == list(range(n))
    streamed = httpx.post(
        f"{cluster.url}/v1/completions",
        json={**sampled, "stream": True, "stream_options": {"include_usage": True}},
        timeout=120,
    )
    tokens, finish, usage = _stream_choices(streamed.text)
    for i in range(n):
        params = SamplingParams(max_tokens=8, temperature=0.9, seed=choice_seed(seed, i))
        ref = engine.generate([prompt], params)[0].token_ids
        assert body.choices[i].token_ids == ref and tokens[i] == ref, i
        assert finish[i] == "length"
    assert usage["completion_tokens"] == 3 * 8 and usage["prompt_tokens"] == len(prompt)
    assert len({tuple(t) for t in tokens.values()}) > 1  # the choices differ

    banned = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    bias = {str(banned): -100.0, "28": 3.5}
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        json={**common, "temperature": 0, "logit_bias": bias},
        timeout=120,
    ).json()
    params = SamplingParams(max_tokens=8, temperature=0, logit_bias=((28, 3.5), (banned, -100.0)))
    ref = engine.generate([prompt], params)[0].token_ids
    assert r["choices"][0]["token_ids"] == ref and banned not in ref

    echoed = httpx.post(
        f"{cluster.url}/v1/completions",
        json={**common, "echo": True, "temperature": 0},
        timeout=120,
    ).json()
    assert echoed["choices"][0]["text"].startswith(text)
    assert len(echoed["choices"][0]["text"]) > len(text)


def test_chat_responses_match_their_schema(cluster: Cluster) -> None:
    r = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        json={**CHAT, "logprobs": True, "top_logprobs": 2, "n": 2, "temperature": 0.5},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = ChatCompletion.model_validate(r.json())
    assert len(body.choices) == 2 and body.usage.completion_tokens == 4
    assert all(c.logprobs is not None and len(c.logprobs.content) == 2 for c in body.choices)
