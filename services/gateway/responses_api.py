"""OpenAI's Responses API (text in, text out): the request body, its translation into
the chat request Baton already serves, and the numbered events of a response.

Every parameter is implemented or refused by name (400), as for chat. A stored
response (``store``, the default) is resumable: its events go to the event log
(:mod:`services.gateway.resumable`), so ``GET /v1/responses/{id}`` (poll, or
``stream=true&starting_after=N``) works at any gateway while the log keeps it, and
``background`` responses go on without a client. Events are numbered
(``sequence_number``) by their place in the sequence, and every timestamp comes from
the request's record, so a gateway continuing a response rebuilds the same events.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any, Literal

from pydantic import Field, model_validator

from services.gateway.openai_types import NAME_PATTERN, _Body, unsupported
from services.gateway.resumable import Emitted
from shared.serving.errors import ServiceError, classify

# the chat request's parameter names -> the Responses API's, for error bodies
PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
TERMINAL = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.cancelled",
}


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: Any = unsupported(None, [])


class InputMessage(_Body):
    type: Literal["message"] | None = None
    id: str | None = Field(default=None, max_length=256)
    status: Any = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs a name and a schema")
        return self

    def response_format(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        schema: dict[str, Any] = {"name": self.name, "schema": self.schema_}
        if self.description is not None:
            schema["description"] = self.description
        if self.strict is not None:
            schema["strict"] = self.strict
        return {"type": "json_schema", "json_schema": schema}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Any = unsupported(None, "medium")


class ResponsesRequest(_Body):
    model: str = Field(min_length=1)
    input: str | list[InputMessage] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # Baton's extension
    stream: bool = False
    background: bool = False
    store: bool = True
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    text: TextConfig | None = None
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    parallel_tool_calls: bool = True
    tools: Any = unsupported(None, [])
    tool_choice: Any = unsupported(None, "none", "auto")
    previous_response_id: Any = unsupported(None)
    conversation: Any = unsupported(None)
    prompt: Any = unsupported(None)
    reasoning: Any = unsupported(None)
    include: Any = unsupported(None, [])
    truncation: Any = unsupported(None, "disabled")
    top_logprobs: Any = unsupported(None, 0)
    max_tool_calls: Any = unsupported(None)
    service_tier: Any = unsupported(None, "auto", "default")
    stream_options: Any = unsupported(None)

    @model_validator(mode="after")
    def _background(self) -> ResponsesRequest:
        if self.background and not self.store:
            raise ValueError("background responses must be stored (store: true)")
        return self

    def chat_body(self) -> dict[str, Any]:
        """The chat request that computes this response."""
        messages: list[dict[str, str]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for m in self.input:
                role = "system" if m.role == "developer" else m.role
                messages.append({"role": role, "content": m.text()})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
        }
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.seed is not None:
            body["seed"] = self.seed
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and (rf := fmt.response_format()) is not None:
            body["response_format"] = rf
        return body


def responses_param(exc: ServiceError) -> ServiceError:
    """A chat-side error, named in the Responses API's words."""
    if exc.param in PARAMS:
        exc.param = PARAMS[exc.param]
    return exc


class ResponseEvents:
    """The events of one response from its generated text steps (see
    :class:`services.gateway.completion.Run`): ``response.created``,
    ``in_progress``, the message item and its text part, a delta per step, then
    the ``done`` events and ``response.completed`` (``incomplete`` when it ran out
    of ``max_output_tokens``, ``failed`` on an error)."""

    def __init__(
        self, body: ResponsesRequest, response_id: str, created_at: int, prompt_tokens: int
    ):
        self.body = body
        self.id = response_id
        self.item_id = "msg_" + response_id.removeprefix("resp_")
        self.created_at = created_at
        self.prompt_tokens = prompt_tokens
        self.seq = 0
        self.text = ""
        self.output_tokens = 0
        self.cached_tokens = 0

    def response(
        self, status: str, output: list[dict[str, Any]] | None = None, **extra: Any
    ) -> dict[str, Any]:
        b = self.body
        fmt = (
            b.text.format.echo()
            if b.text is not None and b.text.format is not None
            else {"type": "text"}
        )
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": b.background,
            "error": None,
            "incomplete_details": None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": b.model,
            "output": output or [],
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": b.store,
            "temperature": b.temperature,
            "text": {"format": fmt},
            "tool_choice": "auto",
            "tools": [],
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": b.user,
            "metadata": b.metadata or {},
        }
        out.update(extra)
        return out

    def message(self, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self.part()]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + self.output_tokens,
        }

    def event(self, kind: str, status: str | None = None, **fields: Any) -> Emitted:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return Emitted(f"event: {kind}\ndata: {text}\n\n", status=status)

    def opening(self) -> list[Emitted]:
        ids: dict[str, Any] = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
            self.event(
                "response.output_item.added", output_index=0, item=self.message("in_progress")
            ),
            self.event("response.content_part.added", **ids, part=self.part()),
        ]

    def delta(self, text: str, tokens: tuple[int, ...], finish: str | None) -> Emitted:
        self.text += text
        ids: dict[str, Any] = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        ev = self.event("response.output_text.delta", **ids, delta=text, logprobs=[])
        return Emitted(ev.data, tokens, finish)

    def closing(self, finish_reason: str | None) -> list[Emitted]:
        ids: dict[str, Any] = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        status = "incomplete" if finish_reason == "length" else "completed"
        details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        final = self.response(
            status, [self.message("completed")], usage=self.usage(), incomplete_details=details
        )
        return [
            self.event("response.output_text.done", **ids, text=self.text, logprobs=[]),
            self.event("response.content_part.done", **ids, part=self.part()),
            self.event("response.output_item.done", output_index=0, item=self.message("completed")),
            self.event(TERMINAL[status], status=status, response=final),
        ]

    def failed(self, exc: BaseException) -> Emitted:
        err = classify(exc if isinstance(exc, Exception) else RuntimeError("stream ended"))
        error = {"code": err.code or "server_error", "message": str(err)}
        final = self.response(
            "failed", [self.message("incomplete")], error=error, usage=self.usage()
        )
        return self.event("response.failed", status="failed", response=final)

    def cancelled(self) -> Emitted:
        final = self.response("cancelled", [self.message("incomplete")], usage=self.usage())
        return self.event("response.cancelled", status="cancelled", response=final)


async def response_events(
    events: ResponseEvents, steps: AsyncIterator[tuple[str, int, str | None]]
) -> AsyncGenerator[Emitted, None]:
    """All of a response's events from its steps (text, token id, finish reason)."""
    for ev in events.opening():
        yield ev
    pending: list[int] = []
    finish: str | None = None
    first = True  # the first delta logs the prompt tokens reused (for a take-over)
    try:
        async for text, token, finish in steps:
            pending.append(token)
            events.output_tokens += 1
            if text or finish is not None:
                ev = events.delta(text, tuple(pending), finish)
                if first:
                    ev, first = replace(ev, cached_tokens=events.cached_tokens), False
                yield ev
                pending = []
            if finish is not None:
                break
    except (Exception, StopAsyncIteration) as exc:
        yield events.failed(exc)
        return
    for ev in events.closing(finish):
        yield ev


def fold(events: list[str]) -> dict[str, Any] | None:
    """The response as its logged events describe it now (a poll): the last lifecycle
    snapshot, with the text so far while it is in progress."""
    snapshot: dict[str, Any] | None = None
    text = ""
    for raw in events:
        data = json.loads(raw.split("data: ", 1)[1])
        if "response" in data:
            snapshot = data["response"]
        elif data["type"] == "response.output_text.delta":
            text += data["delta"]
    if snapshot is not None and snapshot["status"] == "in_progress" and text:
        snapshot = dict(snapshot)
        snapshot["output"] = [
            {
                "id": "msg_" + str(snapshot["id"]).removeprefix("resp_"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                ],
            }
        ]
    return snapshot
