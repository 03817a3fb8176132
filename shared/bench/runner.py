"""Sending the workload: open loop (each request at its arrival time), fixed
concurrency (closed loop), and conversations (a turn waits for the previous one).

One long-lived ``httpx.AsyncClient`` per run. Every request streams with
``stream_options.include_usage``: from ``/v1/completions`` with token-id prompts
and ``ignore_eos`` (unless its output is constrained), or, when the workload
brings messages (tool calls), from ``/v1/chat/completions``. A chunk that carries
output stamps the time. A request that fails (status, broken stream, timeout) is
recorded with its error, never dropped.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from shared.bench.metrics import RequestResult
from shared.bench.workload import RequestSpec, synthetic_prompt

Progress = Callable[[], None]


@dataclass(frozen=True)
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000 (without /v1)
    model: str
    api_key: str | None = None
    timeout_s: float = 600.0
    resumable: bool = False  # Baton's stream_options.resumable (numbered, logged events)


async def discover_model(http: httpx.AsyncClient, base_url: str) -> str:
    r = await http.get(base_url + "/v1/models")
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


async def send(
    http: httpx.AsyncClient, target: Target, spec: RequestSpec, prompt: Sequence[int] | None = None
) -> tuple[RequestResult, list[int]]:
    """One streamed request (``prompt`` overrides the spec's, for later turns); returns
    its timeline and the output token ids when the server reports them (Baton and vLLM
    do with ``return_token_ids``)."""
    prompt = spec.prompt if prompt is None else prompt
    path, body = _request_body(target, spec, prompt)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    start = time.perf_counter()
    stamps: list[float] = []
    tokens: list[int] = []
    usage_tokens: int | None = None
    cached: int | None = None
    error: str | None = None
    texts: list[str] = []
    calls: dict[int, list[str]] = {}  # chat: tool call index -> [name, arguments]
    prompt_tokens = len(prompt)
    finish: str | None = None
    try:
        async with http.stream("POST", target.base_url + path, json=body, headers=headers) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = f"stream error: {chunk['error'].get('message', '')[:200]}"
                        break
                    if chunk.get("choices"):
                        choice = chunk["choices"][0]
                        delta = choice.get("delta") or {}
                        shown = spec.chat is None or _chat_delta(delta, texts, calls)
                        if shown or choice.get("token_ids"):  # held-back tokens count too
                            stamps.append(time.perf_counter())
                        tokens += choice.get("token_ids") or []
                        if spec.chat is None:
                            texts.append(choice.get("text") or "")
                        finish = choice.get("finish_reason") or finish
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        usage_tokens = int(usage["completion_tokens"])
                        if spec.chat is not None:
                            prompt_tokens = int(usage["prompt_tokens"])
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            cached = int(details["cached_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    # content chunks plus the final finish-reason chunk (no token); trust usage when given
    output = usage_tokens if usage_tokens is not None else max(0, len(stamps) - 1)
    content_stamps = stamps[:output] if output else stamps
    result = RequestResult(
        prompt_tokens=prompt_tokens,
        output_tokens=output,
        start=start,
        chunk_times=tuple(content_stamps),
        end=time.perf_counter(),
        error=error,
        cached_tokens=cached,
        turn=spec.turn if spec.conversation is not None else None,
        oracle_cached=spec.oracle_cached,
        text="".join(texts) if spec.structured is not None or spec.chat is not None else None,
        finish_reason=finish,
        tool_calls=tuple((c[0], c[1]) for _, c in sorted(calls.items())) if calls else None,
    )
    return result, tokens


def _request_body(
    target: Target, spec: RequestSpec, prompt: Sequence[int]
) -> tuple[str, dict[str, Any]]:
    """The endpoint and body: completions over token ids (``ignore_eos``: exactly
    ``max_tokens``), or chat when the spec carries messages."""
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.resumable:
        body["stream_options"]["resumable"] = True
    if spec.seed is not None:
        body |= {"temperature": 0.8, "seed": spec.seed}
    if spec.chat is not None:  # a chunk per token, even while a tool call is held back
        return "/v1/chat/completions", body | {"return_token_ids": True} | spec.chat
    body |= {"prompt": list(prompt), "ignore_eos": True, "return_token_ids": True}
    if spec.structured is not None:  # the output ends where its schema closes
        body |= {"structured_outputs": spec.structured, "ignore_eos": False}
    return "/v1/completions", body


def _chat_delta(delta: dict[str, Any], texts: list[str], calls: dict[int, list[str]]) -> bool:
    """Collect a chat chunk's content and tool-call pieces; whether it carried output."""
    if delta.get("content"):
        texts.append(delta["content"])
    for call in delta.get("tool_calls") or []:
        entry = calls.setdefault(int(call.get("index", 0)), ["", ""])
        fn = call.get("function") or {}
        entry[0] += fn.get("name") or ""
        entry[1] += fn.get("arguments") or ""
    return bool(delta.get("content") or delta.get("tool_calls"))


async def run_open_loop(
    target: Target, specs: Sequence[RequestSpec], progress: Progress, limit: int | None = None
) -> tuple[list[RequestResult], float]:
    """Each request at its arrival offset (``limit`` caps concurrency, None = no cap)."""
    results: list[RequestResult | None] = [None] * len(specs)
    gate = asyncio.Semaphore(limit) if limit else None
    async with _client(target) as http:
        t0 = time.perf_counter()

        async def one(i: int, spec: RequestSpec) -> None:
            await asyncio.sleep(max(0.0, spec.arrival - (time.perf_counter() - t0)))
            if gate is None:
                results[i], _ = await send(http, target, spec)
            else:
                async with gate:
                    results[i], _ = await send(http, target, spec)
            progress()

        await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
        duration = time.perf_counter() - t0
    return [r for r in results if r is not None], duration


async def run_conversations(
    target: Target, specs: Sequence[RequestSpec], progress: Progress, seed: int = 0
) -> tuple[list[RequestResult], float]:
    """Multi-turn: turn k+1 = turn k's prompt + its answer + new user tokens, sent its
    think time after turn k's answer ended."""
    rng = random.Random(seed)
    by_conv: dict[int, list[RequestSpec]] = defaultdict(list)
    for s in specs:
        by_conv[s.conversation if s.conversation is not None else -1].append(s)
    results: list[RequestResult] = []
    async with _client(target) as http:
        t0 = time.perf_counter()

        async def conversation(turns: list[RequestSpec]) -> None:
            await asyncio.sleep(max(0.0, turns[0].arrival - (time.perf_counter() - t0)))
            history: list[int] = []
            for k, turn in enumerate(turns):
                prompt = list(turn.prompt) if k == 0 else history + list(turn.prompt)
                await asyncio.sleep(turn.think_s)
                result, answer = await send(http, target, turn, prompt)
                results.append(result)
                progress()
                if not result.ok:
                    return
                if len(answer) != result.output_tokens:  # server does not return ids
                    answer = list(synthetic_prompt(result.output_tokens, rng))
                history = prompt + answer

        await asyncio.gather(*(conversation(t) for t in by_conv.values()))
        duration = time.perf_counter() - t0
    return results, duration


def _client(target: Target) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(target.timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
    )
