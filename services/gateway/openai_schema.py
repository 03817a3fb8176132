"""Response models of the public API, for ``/openapi.json`` and for tests that check the
responses against them. The handlers build plain dicts (faster on the token path); these
models describe those dicts exactly, extensions included."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from services.gateway.openai_types import ChatCompletionRequest, CompletionRequest
from services.gateway.responses_api import ResponsesRequest

REF = "#/components/schemas/{model}"


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    error: ErrorDetail


class Model(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    dtype: list[str]


class ModelList(_Out):
    object: Literal["list"]
    data: list[Model]


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob]


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | None = None


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | None = None


class Completion(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class OutputText(_Out):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(_Out):
    id: str
    type: Literal["message"]
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(_Out):
    """A response of the Responses API (``object: response``); more fields echo the
    request (``instructions``, ``temperature``, ``text``, ``metadata``...)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[OutputMessage]
    usage: ResponseUsage | None
    error: dict[str, str] | None
    incomplete_details: dict[str, str] | None
    background: bool
    store: bool


class DeletedResponse(_Out):
    id: str
    object: Literal["response"]
    deleted: bool


class Readiness(BaseModel):
    """``/ready``: 200 once every role has a live instance, else 503; then the number of
    live instances of each role (``prefill``, ``decode``; or ``colocated``)."""

    model_config = ConfigDict(extra="allow")

    status: Literal["ready", "waiting"]
    redis: bool
    gateway: str  # this gateway's instance id (owner of the resumable responses it makes)
    __pydantic_extra__: dict[str, int]


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in {
        400: "Invalid request: the parameter at fault is named in error.param",
        401: "Missing or wrong API key",
        404: "Unknown model",
        413: "Request body too large",
        429: "Overloaded; retry after the Retry-After header's seconds",
        503: "No live instance of a role",
    }.items()
}

STREAM_NOTE = (
    "With stream=true the body is text/event-stream: one `data: {json}` event per "
    "chunk (object chat.completion.chunk or text_completion), then `data: [DONE]`."
)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """An ``openapi_extra`` that documents a handler's raw JSON body as ``model``."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
    }


def ok_response(
    model: type[BaseModel], streams: bool, note: str | None = None
) -> dict[int | str, dict[str, Any]]:
    event = {
        "type": "object",
        "properties": {
            "event": {"type": "string"},
            "data": {"type": "string", "description": "a JSON chunk, or [DONE] last"},
        },
        "required": ["data"],
    }
    content: dict[str, Any] = {"text/event-stream": {"schema": event}}
    return {
        200: {
            "model": model,
            "description": note or (STREAM_NOTE if streams else "OK"),
            "content": content if streams else {},
        },
        **ERRORS,
    }


def with_links(
    responses: dict[int | str, dict[str, Any]], links: dict[str, str]
) -> dict[int | str, dict[str, Any]]:
    """``responses`` whose 200 links to the operations (by id) that take its body's
    ``id`` as ``response_id`` (what a client, or a stateful fuzzer, calls next)."""
    out = dict(responses)
    out[200] = {
        **out[200],
        "links": {
            name: {"operationId": op, "parameters": {"response_id": "$response.body#/id"}}
            for name, op in links.items()
        },
    }
    return out


def request_schemas() -> dict[str, Any]:
    """JSON schemas of the request bodies and everything they refer to."""
    _, top = models_json_schema(
        [
            (ChatCompletionRequest, "validation"),
            (CompletionRequest, "validation"),
            (ResponsesRequest, "validation"),
        ],
        ref_template=REF,
    )
    return dict(top.get("$defs", {}))


RESUMABLE_NOTE = (
    "text/event-stream: the events of a resumable response after the cursor, each with "
    "its sequence number as the SSE `id`; the cursor is the Last-Event-ID header, else "
    "`starting_after` (absent or -1: from the first). 404 unknown id (or another API "
    "key's), 400 a cursor past the log, 410 a cursor the log no longer covers."
)
RESPONSES_NOTE = (
    "A response object; with stream=true, text/event-stream: `event: <type>` and "
    "`data: {json}` per event (response.created, response.in_progress, "
    "response.output_item.added, response.content_part.added, response.output_text.delta, "
    "..., response.completed / incomplete / failed / cancelled), each with its "
    "sequence_number (also the SSE `id`)."
)
