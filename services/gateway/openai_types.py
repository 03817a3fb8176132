"""OpenAI request bodies, validated at the edge (unknown fields are ignored, as OpenAI does).

Extensions, as vLLM names them: ``top_k``, ``ignore_eos``, ``cache_salt``,
``return_token_ids`` (token ids in every choice, prompt ids once).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

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
    n: int = Field(default=1, ge=1)
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

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

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
    prompt: str | Annotated[list[int], Field(min_length=1)] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

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
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs
