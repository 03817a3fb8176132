"""Request validation at the edge and the shape of responses (no cluster needed)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from services.gateway.handoff import Generated
from services.gateway.openai_types import ChatCompletionRequest, CompletionRequest
from services.gateway.responses import Choices, Prepared
from shared.engine.constraint import Constraint
from shared.model.loader import LoadedModel
from shared.serving.protocol import WireToken


def test_chat_limits_and_extensions() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 5,
            "max_tokens": 9,
            "logprobs": True,
            "top_logprobs": 3,
            "stop": "x",
            "tools": [],
            "response_format": {"type": "text"},
        }
    )
    assert body.limit() == 5 and body.num_logprobs() == 3 and body.stop_list() == ("x",)
    assert body.message_dicts() == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "bad",
    [
        {"n": 17},
        {"unknown_field": 1},
        {"tools": [{"type": "function"}]},  # no function
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
        {"tools": [{"type": "function", "function": {"name": "has space"}}]},
        {"response_format": {"type": "json_schema"}},  # no schema
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},  # two at once
        {"structured_outputs": {}},
        {"logit_bias": {"x": 1}},
        {"stream_options": {"include_usage": True}},
        {"max_tokens": 0},
        {"temperature": 2.5},
        {"stop": ["a"] * 17},
        {"top_logprobs": 2},
        {"messages": []},
    ],
)
def test_chat_rejects(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], **bad}
        )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # and no tools
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
    ],
)
def test_parameters_that_do_not_fit_together_are_named(
    extra: dict[str, object], param: str
) -> None:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    )
    problem = body.problem()
    assert problem is not None and problem[0] == param


def test_structured_outputs_and_tools_become_a_constraint() -> None:
    def chat(**kw: object) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
        )

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    assert chat(response_format=fmt).constraint() == Constraint.json_schema(schema)
    assert chat(response_format={"type": "json_object"}).constraint() == Constraint.json_object()
    assert chat(structured_outputs={"choice": ["a", "b"]}).constraint() == Constraint.choice(
        ["a", "b"]
    )
    assert chat(structured_outputs={"json": '{"type": "string"}'}).constraint() == (
        Constraint.json_schema({"type": "string"})
    )
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    auto = chat(tools=[tool])
    assert auto.tool_plan() is not None and auto.constraint() is None
    named = chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})
    c = named.constraint()
    assert c is not None and c.kind == "grammar" and "<tool_call>" in c.spec
    assert chat(tools=[tool], tool_choice="none").tool_plan() is None
    assert "<tools>" in auto.message_dicts()[0]["content"]


def test_completion_prompt_forms() -> None:
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["one"]}).prompt == "one"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompt == [1, 2]
    bodies: list[dict[str, object]] = [
        {"prompt": ["a", "b"]},
        {"prompt": []},
        {"prompt": "x", "echo": True, "logprobs": 1},
        {"prompt": "x", "suffix": "y"},
        {"prompt": "x", "best_of": 3},
    ]
    for body in bodies:
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"model": "m", **body})


def test_stop_string_ends_the_text_and_usage_counts_tokens(loaded_fp32: LoadedModel) -> None:
    tok = loaded_fp32.tokenizer
    ids = tok.encode("Hello world. Goodbye moon.", add_special_tokens=False)
    prepared = Prepared(
        kind="completion", request_id="r", model="m", prompt=[1, 2, 3], max_tokens=50,
        stop=(" Goodbye",), num_logprobs=None, include_usage=True, return_token_ids=True,
    )  # fmt: skip
    choices = Choices(prepared, tok)
    builder = choices.builders[0]
    steps = []
    for tid in ids:
        steps.append(builder.add(Generated(WireToken(id=tid), None)))
        if steps[-1].finish_reason:
            break
    assert "".join(s.text for s in steps) == "Hello world."
    assert builder.finish_reason == "stop"
    body = choices.response([steps])
    assert body["usage"]["completion_tokens"] == len(steps) < len(ids)
    assert body["choices"][0]["text"] == "Hello world."
    usage = json.loads(choices.usage_chunk()[len("data: ") :])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 3 + len(steps)
