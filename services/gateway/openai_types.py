"""OpenAI request bodies, validated at the edge.

Every parameter of OpenAI's chat and completions APIs is either implemented or
refused with a 400 that names it; a parameter that is not OpenAI's (nor one of
the extensions below) is refused too, as OpenAI refuses it. A refused OpenAI
parameter is still accepted at its neutral value (``tools: []``,
``response_format: {"type": "text"}``, ``store: false``), which changes nothing.

Extensions, as vLLM names them: ``top_k``, ``ignore_eos``, ``cache_salt``,
``return_token_ids`` (token ids in every choice, prompt ids once).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_STOP = 16
MAX_N = 16
MAX_LOGIT_BIAS = 300
UNSUPPORTED = "x-baton-unsupported"


def unsupported(*accepted: Any) -> Any:
    """A parameter Baton does not implement: only its neutral values are accepted (the
    schema lists them; :meth:`_Body._neutral` refuses anything else by name)."""
    return Field(default=None, json_schema_extra={"enum": list(accepted), UNSUPPORTED: True})


class _Body(BaseModel):
    # strict: no coercion (``"echo": 0`` or ``"n": "2"`` is refused, as OpenAI refuses it)
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*")
    @classmethod
    def _neutral(cls, value: Any, info: ValidationInfo) -> Any:
        extra = cls.model_fields[str(info.field_name)].json_schema_extra
        if not isinstance(extra, dict) or not extra.get(UNSUPPORTED):
            return value
        accepted = extra["enum"]
        if not isinstance(accepted, list):
            raise TypeError(f"{info.field_name}: unsupported() without a list of values")
        if not any(value == a and type(value) is type(a) for a in accepted):
            shown = " or ".join(json.dumps(a) for a in accepted)
            raise ValueError(
                f"'{info.field_name}' is not supported by Baton (only {shown} is accepted)"
            )
        return value


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: Any = unsupported(None, False)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class SamplingFields(_Body):
    """The fields chat and completions share."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: (
        dict[
            Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
            Annotated[float, Field(ge=-100.0, le=100.0)],
        ]
        | None
    ) = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    ignore_eos: bool = False
    cache_salt: str | None = Field(default=None, max_length=256)
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        if any(not k.isdigit() or len(k) > 9 for k in value):
            raise ValueError("keys must be token ids (decimal strings)")
        return value

    @model_validator(mode="after")
    def _stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ResponseFormat:
        if self.type != "text":
            raise ValueError(
                f"type {self.type!r} is not supported by Baton (no constrained decoding); "
                "only 'text' is accepted"
            )
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    # OpenAI parameters Baton does not implement: refused unless neutral
    tools: Any = unsupported(None, [])
    tool_choice: Any = unsupported(None, "none")
    parallel_tool_calls: Any = unsupported(None, False, True)
    functions: Any = unsupported(None, [])
    function_call: Any = unsupported(None, "none")
    audio: Any = unsupported(None)
    modalities: Any = unsupported(None, ["text"])
    prediction: Any = unsupported(None)
    reasoning_effort: Any = unsupported(None)
    verbosity: Any = unsupported(None)
    web_search_options: Any = unsupported(None)
    store: Any = unsupported(None, False)
    metadata: Any = unsupported(None, {})
    service_tier: Any = unsupported(None, "auto", "default")
    # Accepted with no effect (like ``user``); the prefix cache is content-addressed
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
    )
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: Any = unsupported(None, "")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported (batch: send several)")
            return str(value[0])
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return value  # type: ignore[return-value]

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (no prompt logprobs)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        return self

    def limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs
