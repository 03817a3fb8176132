"""``baton bench --workload tools``: chat requests that offer tools, with
``tool_choice`` cycling through ``required``, a named function and ``auto``, each
answer checked: every call names an offered tool and its arguments validate against
that tool's parameters; ``auto`` may answer in words instead.

Parameters are bounded (string lengths, ranges, item counts) for the reason
:mod:`shared.bench.structured` gives; calls are one at a time
(``parallel_tool_calls`` false), so a small model cannot chain calls until
``max_tokens``.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

from shared.bench.metrics import RequestResult
from shared.bench.structured import Validity
from shared.bench.workload import RequestSpec


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> Any:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


CURRENCIES = ["USD", "EUR", "JPY", "GBP"]
TOOLS = [
    _tool(
        "get_weather",
        "Current weather in a city",
        {
            "city": {"type": "string", "maxLength": 32},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        ["city", "unit"],
    ),
    _tool(
        "search_web",
        "Search the web",
        {
            "query": {"type": "string", "maxLength": 80},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
        },
        ["query"],
    ),
    _tool(
        "convert_currency",
        "Convert an amount between currencies",
        {
            "amount": {"type": "integer", "minimum": 0, "maximum": 1000000},
            "from": {"enum": CURRENCIES},
            "to": {"enum": CURRENCIES},
        },
        ["amount", "from", "to"],
    ),
    _tool(
        "create_event",
        "Put an event on the calendar",
        {
            "title": {"type": "string", "maxLength": 40},
            "date": {"type": "string", "format": "date"},
            "attendees": {
                "type": "array",
                "items": {"type": "string", "maxLength": 24},
                "maxItems": 4,
            },
        },
        ["title", "date"],
    ),
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Denver", "Pune", "Cairo", "Perth"]
TOPICS = ["solar panels", "sourdough", "rust async", "tide tables", "chess openings"]
CHOICES = ("required", "named", "auto")


def _ask(tool: str, k: int, rng: random.Random) -> str:
    """A user message that calls for ``tool`` (``k`` keeps every prompt unique)."""
    if tool == "get_weather":
        return f"Request {k}: what is the weather in {rng.choice(CITIES)} right now?"
    if tool == "search_web":
        return f"Request {k}: find me the {rng.randint(2, 6)} best pages on {rng.choice(TOPICS)}."
    if tool == "convert_currency":
        a, b = rng.sample(CURRENCIES, 2)
        return f"Request {k}: how much is {rng.randint(5, 5000)} {a} in {b}?"
    return f"Request {k}: add 'Review with {rng.choice(CITIES)} team' on 2026-12-{k % 28 + 1:02d}."


def tool_requests(
    n: int, output_len: int, times: Sequence[float], seed: int = 0
) -> list[RequestSpec]:
    """``n`` chat requests; tool_choice cycles required / named / auto; every other
    one sampled with a seed, the rest greedy."""
    rng = random.Random(seed)
    specs = []
    for i, t in enumerate(times[:n]):
        tool = TOOLS[i % len(TOOLS)]["function"]["name"]
        kind = CHOICES[i % len(CHOICES)]
        choice: Any = kind
        if kind == "named":
            choice = {"type": "function", "function": {"name": tool}}
        chat = {
            "messages": [{"role": "user", "content": _ask(tool, i, rng)}],
            "tools": TOOLS,
            "tool_choice": choice,
            "parallel_tool_calls": False,
        }
        seeded = rng.randrange(1 << 30) if (i // len(CHOICES)) % 2 else None
        specs.append(RequestSpec((), output_len, t, label=f"{kind}:{tool}", seed=seeded, chat=chat))
    return specs


def check(specs: Sequence[RequestSpec], results: Sequence[RequestResult]) -> Validity:
    """Each answer against what its tool_choice demands."""
    import jsonschema

    valid = cut = 0
    invalid: Counter[str] = Counter()
    for spec, r in zip(specs, results, strict=True):
        if spec.label is None or not r.ok:
            continue
        kind, _, tool = spec.label.partition(":")
        if r.finish_reason == "length":
            cut += 1
            continue
        calls = r.tool_calls or ()
        if not calls:
            if kind == "auto" and r.text:
                valid += 1
            else:
                invalid[f"{spec.label} (no call)"] += 1
            continue
        try:
            for name, arguments in calls:
                if name not in PARAMETERS or (kind == "named" and name != tool):
                    raise ValueError(f"called {name!r}")
                jsonschema.validate(json.loads(arguments), PARAMETERS[name])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            invalid[spec.label] += 1
    return Validity(len(results), valid, cut, dict(invalid))
