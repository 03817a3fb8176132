"""What a request's output must match: a JSON schema, any JSON object, a regular
expression, one of several strings, or a grammar. A plain value (no grammar library
here): it travels in :class:`~shared.engine.sampling_params.SamplingParams` from the
gateway to prefill and decode, and every instance builds the same matcher from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[ConstraintKind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """``spec``: the JSON schema (canonical JSON text), the regex, the choices (a JSON
    list of strings), or the grammar (Lark syntax, llguidance's dialect); empty for
    ``json_object``."""

    kind: ConstraintKind
    spec: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> Constraint:
        return cls("json_schema", canonical_json(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def grammar(cls, lark: str) -> Constraint:
        return cls("grammar", lark)


def canonical_json(value: Any) -> str:
    """The value as compact JSON, keys in their given order (a schema's property order
    is the order its output's keys are generated in), so equal schemas share a grammar."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
