"""End to end through the official ``openai`` client against a real local cluster
(2 prefill + 2 decode + KV store + redis-server): the disaggregated token ids
equal the in-process engine's, greedy and seeded, chat and completions,
streaming and not, many requests at once."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from shared.engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory
from tests.services.conftest import MODEL, Cluster, serving_reference

STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting "
    "the steps as his father had taught him. Ships passed far out at sea, their lights "
    "blinking like slow stars, and the wind carried the smell of salt and rain. "
)


@dataclass(frozen=True)
class Case:
    kind: str  # "chat" | "completion"
    stream: bool
    text: str
    max_tokens: int
    temperature: float
    seed: int | None
    top_p: float = 1.0

    def params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
        )


def make_cases() -> list[Case]:
    cases = []
    for i in range(24):
        words = STORY.split()
        n_words = [3, 9, 20, 45, 80, 150, 260, 40][i % 8]
        text = " ".join((words * 8)[i : i + n_words])
        seeded = i % 2 == 1
        cases.append(
            Case(
                kind="chat" if i % 3 == 0 else "completion",
                stream=i % 4 < 2,
                text=text,
                max_tokens=6 + i % 7,
                temperature=0.8 if seeded else 0.0,
                top_p=0.95 if seeded else 1.0,
                seed=1000 + i if seeded else None,
            )
        )
    return cases


async def run_case(client: AsyncOpenAI, case: Case) -> tuple[list[int], list[int], str]:
    extra: dict[str, Any] = {"return_token_ids": True}
    common: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": case.max_tokens,
        "temperature": case.temperature,
        "top_p": case.top_p,
        "extra_body": extra,
    }
    if case.seed is not None:
        common["seed"] = case.seed
    prompt_ids: list[int] = []
    tokens: list[int] = []
    finish = ""
    if case.kind == "chat":
        messages: Any = [{"role": "user", "content": case.text}]
        if case.stream:
            stream = await client.chat.completions.create(messages=messages, stream=True, **common)
            async for chunk in stream:
                extra_fields = chunk.model_extra or {}
                prompt_ids = extra_fields.get("prompt_token_ids") or prompt_ids
                for choice in chunk.choices:
                    tokens += (choice.model_extra or {}).get("token_ids") or []
                    finish = choice.finish_reason or finish
        else:
            resp = await client.chat.completions.create(messages=messages, **common)
            prompt_ids = (resp.model_extra or {})["prompt_token_ids"]
            tokens = (resp.choices[0].model_extra or {})["token_ids"]
            finish = resp.choices[0].finish_reason
    else:
        if case.stream:
            cstream = await client.completions.create(prompt=case.text, stream=True, **common)
            async for chunk in cstream:
                prompt_ids = (chunk.model_extra or {}).get("prompt_token_ids") or prompt_ids
                for c in chunk.choices:
                    tokens += (c.model_extra or {}).get("token_ids") or []
                    finish = c.finish_reason or finish
        else:
            cresp = await client.completions.create(prompt=case.text, **common)
            prompt_ids = (cresp.model_extra or {})["prompt_token_ids"]
            tokens = (cresp.choices[0].model_extra or {})["token_ids"]
            finish = cresp.choices[0].finish_reason
    return prompt_ids, tokens, finish


def test_tokens_match_in_process_engine(cluster: Cluster, make_engine: EngineFactory) -> None:
    cases = make_cases()

    async def run_all() -> list[tuple[list[int], list[int], str]]:
        client = AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(run_case(client, c) for c in cases))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    engine = serving_reference(make_engine)
    tok = engine.tokenizer
    lengths = set()
    for case, (prompt_ids, tokens, finish) in zip(cases, results, strict=True):
        expected_prompt = (
            tok.encode_chat([{"role": "user", "content": case.text}])
            if case.kind == "chat"
            else tok.encode(case.text)
        )
        assert prompt_ids == expected_prompt
        lengths.add(len(prompt_ids))
        ref = engine.generate([expected_prompt], case.params())[0]
        assert tokens == ref.token_ids, case
        assert finish == ref.finish_reason.value
    assert len(lengths) >= 8  # mixed prompt lengths, single blocks to many


def sse_events(raw: str) -> list[str]:
    return [block[len("data: ") :] for block in raw.split("\n\n") if block.startswith("data: ")]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_sse_conformance(cluster: Cluster, kind: str) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 7,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "logprobs": True if kind == "chat" else 2,
        "return_token_ids": True,
    }
    if kind == "chat":
        body |= {
            "messages": [{"role": "user", "content": "Name three colours."}],
            "top_logprobs": 2,
        }
        path = "/v1/chat/completions"
    else:
        body["prompt"] = "The three primary colours are"
        path = "/v1/completions"
    with httpx.stream("POST", cluster.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"]
        raw = r.read().decode()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage, final, content = chunks[-1], chunks[-2], chunks[:-2]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    assert all(c["object"] == obj and c["model"] == MODEL for c in chunks)
    # the first chunk with choices carries the first token (no empty role-only chunk)
    assert len(content) == 7
    tokens = [t for c in content for t in c["choices"][0]["token_ids"]]
    assert len(tokens) == 7
    if kind == "chat":
        assert content[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("content" in c["choices"][0]["delta"] for c in content)
        lp = [c["choices"][0]["logprobs"]["content"][0] for c in content]
        assert all(len(x["top_logprobs"]) == 2 for x in lp)
    else:
        lp = [c["choices"][0]["logprobs"] for c in content]
        assert all(len(x["tokens"]) == 1 and len(x["top_logprobs"][0]) <= 2 for x in lp)
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    assert final["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    prompt_len = len(content[0]["prompt_token_ids"])
    cached = usage["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 <= cached < prompt_len and cached % 16 == 0
    assert usage["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 7,
        "total_tokens": prompt_len + 7,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def test_non_streaming_usage_and_text(cluster: Cluster, make_engine: EngineFactory) -> None:
    r = httpx.post(
        cluster.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_completion_tokens": 20,
            "temperature": 0,
        },
        timeout=120,
    )
    assert r.status_code == 200
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"
    engine = serving_reference(make_engine)
    prompt = engine.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    ref = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == len(ref.token_ids)
    assert body["choices"][0]["message"]["content"] == ref.text


def test_stop_string_cuts_text_and_frees_decode(cluster: Cluster) -> None:
    r = httpx.post(
        cluster.url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "Count: one, two, three, four,",
            "max_tokens": 30,
            "temperature": 0,
            "stop": [" seven"],
        },
        timeout=120,
    )
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert " seven" not in choice["text"]
    assert choice["text"].startswith(" five")


def test_request_id_follows_the_request_and_metrics_count_it(cluster: Cluster) -> None:
    client_id = f"trace-{uuid.uuid4().hex[:8]}"
    r = httpx.post(
        cluster.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Trace me", "max_tokens": 3, "ignore_eos": True},
        headers={"X-Request-Id": client_id},
        timeout=120,
    )
    # the client's id is echoed; the gateway's own id keys the request everywhere
    assert r.status_code == 200 and r.headers["x-request-id"] == client_id
    rid = r.headers["x-baton-request-id"]
    assert rid != client_id and r.json()["id"] == f"cmpl-{rid}"
    seen: set[str] = set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and seen != {"gateway", "prefill", "decode"}:
        for spec in cluster.local.specs:
            log_file = cluster.local.log_dir / f"{spec.name}.log" if cluster.local.log_dir else None
            if log_file is None or not log_file.exists():
                continue
            for line in log_file.read_text().splitlines():
                if rid in line:
                    entry = json.loads(line)  # JSON lines, one object each
                    assert entry["request_id"] == rid
                    seen.add(entry["service"])
        time.sleep(0.2)
    assert seen == {"gateway", "prefill", "decode"}
    metrics = httpx.get(cluster.url + "/metrics", timeout=10).text
    for name in ("ttft", "tpot", "itl", "e2e"):
        count = re.search(rf"^baton_{name}_seconds_count (\S+)$", metrics, re.M)
        assert count is not None and float(count.group(1)) > 0, name
    assert re.search(r'^baton_live_instances\{role="decode"\} 2.0$', metrics, re.M)
    assert re.search(r'^baton_queue_depth\{role="prefill"\} ', metrics, re.M)
    for spec in cluster.local.specs:
        if spec.role in ("prefill", "decode"):
            worker = httpx.get(f"http://127.0.0.1:{spec.http_port}/metrics", timeout=10).text
            steps = re.search(r"^baton_engine_step_seconds_count (\S+)$", worker, re.M)
            assert steps is not None, spec.name  # every worker exports its step times
