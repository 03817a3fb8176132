"""OpenAI response shapes: streamed chunks, whole responses, logprobs, usage.

Text is produced here, at the gateway: tokens are detokenized incrementally
and stop strings are applied on the text (the stop string itself is not
returned; generation ends where it appears).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from services.gateway.handoff import Generated
from services.gateway.tools import ToolCallStream, ToolPlan, parse_output
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.model.tokenizer import Tokenizer

Kind = Literal["chat", "completion"]


@dataclass
class Prepared:
    """A validated request, ready to run."""

    kind: Kind
    request_id: str
    model: str
    prompt: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    num_logprobs: int | None
    include_usage: bool
    return_token_ids: bool
    stream: bool = False
    cache_salt: str | None = None
    n: int = 1
    echo: str = ""  # completions' ``echo``: the prompt's text, put before the first token's
    tools: ToolPlan | None = None  # chat with tools: calls parsed out of the output
    created: int = field(default_factory=lambda: int(time.time()))
    resumable: bool = False  # its events are logged and numbered (stream_options.resumable)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id


@dataclass
class Step:
    """What one generated token adds to the response."""

    text: str
    token: int
    logprobs: Any  # kind-specific logprobs entry, or None
    finish_reason: str | None


class ResponseBuilder:
    """Turns generated tokens into OpenAI chunks (or one response) for one request."""

    def __init__(self, prepared: Prepared, tokenizer: Tokenizer, index: int = 0):
        self.p = prepared
        self.index = index
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, stop=prepared.stop)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._chunks = 0
        self._text_offset = 0
        tools = prepared.tools
        self.calls = ToolCallStream(tools.mode != "auto") if tools is not None else None

    # -- tokens -> text ------------------------------------------------------------
    def add(self, gen: Generated) -> Step:
        self.token_ids.append(gen.token.id)
        text = self.detok.add([gen.token.id])
        if len(self.token_ids) == 1:
            text = self.p.echo + text
        reason = gen.finish_reason
        if self.detok.stopped_by is not None:
            reason = "stop"
        if reason is not None:
            text += self.detok.finish()
            self.finish_reason = "stop" if reason == "abort" else reason
        return Step(text, gen.token.id, self._logprobs(gen), self.finish_reason)

    def _token_str(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _logprobs(self, gen: Generated) -> Any:
        if self.p.num_logprobs is None or gen.token.logprob is None:
            return None
        tok = self._token_str(gen.token.id)
        top = gen.token.top or []
        if self.p.kind == "chat":
            return {
                "token": tok,
                "logprob": gen.token.logprob,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": (s := self._token_str(t)), "logprob": v, "bytes": list(s.encode())}
                    for t, v in top
                ],
            }
        return {
            "token": tok,
            "logprob": gen.token.logprob,
            "top": {self._token_str(t): v for t, v in top},
        }

    # -- streaming -------------------------------------------------------------------
    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.p.kind == "chat" else "text_completion"
        return {
            "id": self.p.response_id,
            "object": obj,
            "created": self.p.created,
            "model": self.p.model,
            "choices": choices,
        }

    def _delta(self, step: Step) -> dict[str, Any] | None:
        """The chat delta of one step; None when it adds nothing a client sees yet (text
        held back while it may be a tool call's start)."""
        if self.calls is None:
            return {"content": step.text}
        found = self.calls.feed(step.text)
        if step.finish_reason is not None:
            found.content += self.calls.finish().content
        delta: dict[str, Any] = {}
        if found.content:
            delta["content"] = found.content
        if found.calls:
            delta["tool_calls"] = found.calls
        return delta or None

    def chunk(self, step: Step) -> str:
        """The SSE chunk of one step ("" when it has nothing to show yet)."""
        if self.p.kind == "chat":
            found = self._delta(step)
            if found is None and not (step.logprobs or self.p.return_token_ids):
                return ""
            delta = found or {"content": ""}
            if self._chunks == 0:
                delta = {"role": "assistant", **delta}
            choice: dict[str, Any] = {
                "index": self.index,
                "delta": delta,
                "logprobs": {"content": [step.logprobs]} if step.logprobs else None,
                "finish_reason": None,
            }
        else:
            choice = {
                "index": self.index,
                "text": step.text,
                "logprobs": self._completion_logprobs([step]) if step.logprobs else None,
                "finish_reason": None,
            }
        if self.p.return_token_ids:
            choice["token_ids"] = [step.token]
        body = self.envelope([choice])
        if self.p.return_token_ids and self._chunks == 0 and self.index == 0:
            body["prompt_token_ids"] = self.p.prompt
        self._chunks += 1
        return sse(body)

    def _final_reason(self) -> str | None:
        """``tool_calls`` when the model ended its output after calling tools."""
        if self.calls is not None and self.calls.calls and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason

    def final_chunk(self) -> str:
        choice: dict[str, Any] = {"index": self.index, "finish_reason": self._final_reason()}
        if self.p.kind == "chat":
            choice |= {"delta": {}, "logprobs": None}
        else:
            choice |= {"text": "", "logprobs": None}
        return sse(self.envelope([choice]))

    # -- whole response ------------------------------------------------------------------
    def choice(self, steps: list[Step]) -> dict[str, Any]:
        text = "".join(s.text for s in steps)
        choice: dict[str, Any] = {"index": self.index, "finish_reason": self.finish_reason}
        has_lp = self.p.num_logprobs is not None
        if self.p.kind == "chat" and self.p.tools is not None:
            content, calls = parse_output(text, self.p.tools.mode != "auto")
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = [c.message() for c in calls]
                if self.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
            choice["logprobs"] = (
                {"content": [s.logprobs for s in steps if s.logprobs]} if has_lp else None
            )
        elif self.p.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = (
                {"content": [s.logprobs for s in steps if s.logprobs]} if has_lp else None
            )
        else:
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs(steps) if has_lp else None
        if self.p.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
        return choice

    def _completion_logprobs(self, steps: list[Step]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for s in steps:
            if not s.logprobs:
                continue
            out["tokens"].append(s.logprobs["token"])
            out["token_logprobs"].append(s.logprobs["logprob"])
            out["top_logprobs"].append(s.logprobs["top"])
            out["text_offset"].append(self._text_offset)
            self._text_offset += len(s.text)
        return out


class Choices:
    """The ``n`` choices of one request: shared envelope and usage."""

    def __init__(self, prepared: Prepared, tokenizer: Tokenizer):
        self.p = prepared
        self.builders = [ResponseBuilder(prepared, tokenizer, i) for i in range(prepared.n)]
        self.cached_tokens = 0  # prompt tokens whose KV was reused (the first choice's)

    def usage(self) -> dict[str, Any]:
        n_prompt = len(self.p.prompt)
        n_out = sum(len(b.token_ids) for b in self.builders)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def usage_chunk(self) -> str:
        body = self.builders[0].envelope([])
        body["usage"] = self.usage()
        return sse(body)

    def response(self, steps: list[list[Step]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.p.response_id,
            "object": "chat.completion" if self.p.kind == "chat" else "text_completion",
            "created": self.p.created,
            "model": self.p.model,
            "choices": [b.choice(s) for b, s in zip(self.builders, steps, strict=True)],
            "usage": self.usage(),
        }
        if self.p.return_token_ids:
            body["prompt_token_ids"] = self.p.prompt
        return body


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
