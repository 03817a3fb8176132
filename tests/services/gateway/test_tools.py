"""Tool calls at the gateway, as pure logic: the prompt the model sees, the grammar of
``required`` and named calls (compiled by the engine's own grammar code), and the
stream of text turned into content and OpenAI ``tool_calls`` deltas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.gateway.tools import (
    CLOSE,
    OPEN,
    Function,
    ToolCallStream,
    ToolPlan,
    parse_output,
    render_messages,
)
from shared.engine.grammar import GrammarCompiler
from shared.model.registry import resolve
from shared.model.tokenizer import Tokenizer

WEATHER = Function(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
TIME = Function("get_time", "", {"type": "object", "properties": {"zone": {"type": "string"}}})


@pytest.fixture(scope="module")
def grammars(cache_dir: Path) -> tuple[GrammarCompiler, Tokenizer]:
    tok = Tokenizer.from_folder(resolve(None, cache_dir, progress=False).folder)
    return GrammarCompiler(tok.to_json(), tok.vocab_size, tok.eos_token_ids), tok


def feed_all(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    content, calls = "", []
    for p in pieces:
        d = stream.feed(p)
        content += d.content
        calls += d.calls
    content += stream.finish().content
    return content, calls


def in_pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def test_required_and_named_grammars_accept_calls_and_nothing_else(
    grammars: tuple[GrammarCompiler, Tokenizer],
) -> None:
    compiler, tok = grammars
    call = OPEN + '{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}' + CLOSE
    other = OPEN + '{"name":"get_time","arguments":{"zone":"CET"}}' + CLOSE
    cases = [
        (ToolPlan((WEATHER, TIME), "required"), call + "\n" + other, True),
        (ToolPlan((WEATHER, TIME), "required", parallel=False), call + "\n" + other, False),
        (ToolPlan((WEATHER, TIME), "named", "get_time"), other, True),
        (ToolPlan((WEATHER, TIME), "named", "get_time"), call, False),
        (ToolPlan((WEATHER,), "required"), "Sure, " + call, False),
        (ToolPlan((WEATHER,), "required"), call.replace('"c"', '"kelvin"'), False),
    ]
    for plan, text, ok in cases:
        constraint = plan.constraint()
        assert constraint is not None
        m = compiler.matcher(constraint)
        accepted = all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))
        assert accepted is ok, (plan.mode, text)
    assert ToolPlan((WEATHER,), "auto").constraint() is None


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11])
def test_constrained_calls_stream_name_first_then_arguments_in_pieces(size: int) -> None:
    text = (
        OPEN + '{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}' + CLOSE + "\n"
        + OPEN + '{"name":"get_time","arguments":{"zone":"CET"}}' + CLOSE
    )  # fmt: skip
    stream = ToolCallStream(incremental=True)
    content, deltas = feed_all(stream, in_pieces(text, size))
    assert content.strip() == ""
    heads = [d for d in deltas if "id" in d]
    assert [(h["index"], h["function"]["name"], h["function"]["arguments"]) for h in heads] == [
        (0, "get_weather", ""),
        (1, "get_time", ""),
    ]
    for index, want in ((0, {"city": "Paris", "unit": "c"}), (1, {"zone": "CET"})):
        pieces = [d["function"]["arguments"] for d in deltas if d["index"] == index]
        assert len(pieces) > 1  # streamed, not in one piece
        assert json.loads("".join(pieces)) == want
    assert [json.loads(c.arguments) for c in stream.calls] == [
        {"city": "Paris", "unit": "c"},
        {"zone": "CET"},
    ]


def test_auto_keeps_text_and_emits_whole_calls_once_closed() -> None:
    text = (
        "Let me check. " + OPEN + '{"name": "get_time", "arguments": {"zone": "UTC"}}' + CLOSE
        + " Also < and <tool are text. " + OPEN + "not json" + CLOSE
    )  # fmt: skip
    content, deltas = feed_all(ToolCallStream(incremental=False), in_pieces(text, 2))
    assert content == "Let me check.  Also < and <tool are text. " + OPEN + "not json" + CLOSE
    assert len(deltas) == 1 and deltas[0]["function"] == {
        "name": "get_time",
        "arguments": '{"zone": "UTC"}',
    }
    # an unclosed block at the end is the model's text
    content, deltas = feed_all(ToolCallStream(incremental=False), [OPEN + '{"name": "x"'])
    assert content == OPEN + '{"name": "x"' and deltas == []


def test_a_whole_output_parses_into_content_and_calls() -> None:
    content, calls = parse_output(
        "Sure. " + OPEN + '{"name":"get_time","arguments":{"zone":"CET"}}' + CLOSE, False
    )
    assert content == "Sure." and [c.name for c in calls] == ["get_time"]
    content, calls = parse_output("No tools needed.", False)
    assert content == "No tools needed." and calls == []


def test_the_prompt_describes_the_tools_and_renders_past_calls() -> None:
    plan = ToolPlan((WEATHER,), "auto")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "18 C"},
    ]
    out = render_messages(messages, plan)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert (
        out[2]["content"]
        == OPEN + '{"name": "get_weather", "arguments": {"city": "Paris"}}' + CLOSE
    )
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
