"""The tools workload's requests and its check of answers (pure logic: results are
built by hand, no server)."""

import json

import jsonschema

from shared.bench import tools
from shared.bench.metrics import RequestResult


def _answer(
    calls: tuple[tuple[str, str], ...] | None, text: str = "", finish: str = "tool_calls"
) -> RequestResult:
    return RequestResult(
        20, 9, 0.0, (0.1, 0.2), 0.2, text=text, finish_reason=finish, tool_calls=calls
    )


def test_requests_cycle_tool_choices_over_every_tool() -> None:
    specs = tools.tool_requests(12, 64, [0.0] * 12, seed=1)
    assert {s.label for s in specs} == {
        f"{c}:{t['function']['name']}" for c in tools.CHOICES for t in tools.TOOLS
    }
    for spec in specs:
        assert spec.chat is not None and spec.chat["parallel_tool_calls"] is False
        kind, _, tool = (spec.label or "").partition(":")
        expected = {"type": "function", "function": {"name": tool}} if kind == "named" else kind
        assert spec.chat["tool_choice"] == expected
    assert len({s.chat["messages"][0]["content"] for s in specs if s.chat}) == 12
    for params in tools.PARAMETERS.values():
        jsonschema.Draft202012Validator.check_schema(params)


def test_check_accepts_valid_calls_and_auto_words_only() -> None:
    required, named, auto = tools.tool_requests(3, 64, [0.0] * 3)
    assert (required.label, named.label) == ("required:get_weather", "named:search_web")
    good = json.dumps({"city": "Oslo", "unit": "celsius"})
    results = [
        _answer((("get_weather", good),)),
        _answer((("get_weather", good),)),  # valid arguments, but not the named tool
        _answer(None, text="It is sunny.", finish="stop"),  # auto may answer in words
    ]
    v = tools.check([required, named, auto], results)
    assert (v.valid, v.cut, v.invalid) == (2, 0, {named.label: 1})
    bad_args = _answer((("get_weather", json.dumps({"city": "Oslo", "unit": "kelvin"})),))
    words = _answer(None, text="Sure.", finish="stop")
    cut = _answer((("get_weather", '{"city": "Os'),), finish="length")
    v = tools.check([required, required, required], [bad_args, words, cut])
    assert (v.valid, v.cut) == (0, 1)
    assert v.invalid == {required.label: 1, f"{required.label} (no call)": 1}
