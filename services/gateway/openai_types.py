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

from services.gateway.tools import NAME_PATTERN, Function, ToolPlan, render_messages
from shared.engine.constraint import Constraint

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
    # Baton's extension: every event numbered and logged, so that the stream can be
    # reattached (GET /v1/chat/completions/{id}/stream) here or at another gateway
    resumable: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class AssistantToolCall(_Body):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's past calls
    tool_call_id: str | None = Field(default=None, max_length=256)  # a tool's result

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


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
        if self.resumable() and self.n > 1:
            raise ValueError("a resumable stream has one choice (n = 1)")
        return self

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def resumable(self) -> bool:
        return bool(self.stream_options and self.stream_options.resumable)


class JsonSchemaFormat(_Body):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema goes with type 'json_schema', not {self.type!r}")
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return Constraint.json_object()
        if self.json_schema is not None:
            return Constraint.json_schema(self.json_schema.schema_)
        return None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self

    def constraint(self) -> Constraint:
        if self.json_ is not None:
            schema = json.loads(self.json_) if isinstance(self.json_, str) else self.json_
            if not isinstance(schema, dict):
                raise ValueError("json must be a JSON schema object")
            return Constraint.json_schema(schema)
        if self.regex is not None:
            return Constraint.regex(self.regex)
        if self.choice is not None:
            return Constraint.choice(self.choice)
        if self.grammar is not None:
            return Constraint.grammar(self.grammar)
        return Constraint.json_object()


class FunctionDefinition(_Body):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str = Field(min_length=1)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI parameters Baton does not implement: refused unless neutral
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

    def problem(self) -> tuple[str, str] | None:
        """``(param, message)`` of the first parameter that does not fit with the others
        (checked after validation, so the error names the parameter)."""
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            return "tools", "function names in tools must be unique"
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            return "tool_choice", "'tool_choice' is only allowed when 'tools' are specified"
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            return "tool_choice", f"function {choice.function.name!r} is not in tools"
        formatted = self.response_format is not None and self.response_format.type != "text"
        if formatted and self.structured_outputs is not None:
            return "structured_outputs", "give response_format or structured_outputs, not both"
        if names and choice != "none" and (formatted or self.structured_outputs is not None):
            return "tools", (
                "tools with response_format or structured_outputs is not supported by Baton: "
                "give one or the other"
            )
        return None

    def tool_plan(self) -> ToolPlan | None:
        """What ``tools`` and ``tool_choice`` ask for (None: no tools in play)."""
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        if not self.tools or choice == "none":
            return None
        functions = tuple(
            Function(
                t.function.name,
                t.function.description or "",
                t.function.parameters,
            )
            for t in self.tools
        )
        if isinstance(choice, NamedToolChoice):
            return ToolPlan(functions, "named", choice.function.name, self.parallel_tool_calls)
        return ToolPlan(functions, choice, parallel=self.parallel_tool_calls)

    def constraint(self) -> Constraint | None:
        plan = self.tool_plan()
        if plan is not None:
            return plan.constraint()
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return self.response_format.constraint() if self.response_format else None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, Any]]:
        """The chat as the template renders it (tools, calls and results in text)."""
        return render_messages([m.as_dict() for m in self.messages], self.tool_plan())


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
    # vLLM's completions take these too
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

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
        formatted = self.response_format is not None and self.response_format.type != "text"
        if self.structured_outputs is not None and formatted:
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def constraint(self) -> Constraint | None:
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return self.response_format.constraint() if self.response_format else None

    def limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs
