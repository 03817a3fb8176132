"""``baton bench --workload structured``: outputs constrained to JSON schemas of
increasing size (sent as vLLM's ``structured_outputs``, so a vLLM server runs the same
workload), each output checked against its schema.

The schemas bound what a small model could otherwise repeat forever (string lengths,
array sizes, number ranges and steps), so an output that does not validate is a failure of the
constraint, not of the model's stamina.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.bench.metrics import RequestResult
from shared.bench.workload import RequestSpec, synthetic_prompt


def _obj(properties: dict[str, Any], required: Sequence[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties if required is None else required),
        "additionalProperties": False,
    }


NAME = {"type": "string", "maxLength": 24}
TEXT = {"type": "string", "maxLength": 60}
# Numbers step by binary fractions: a bound on their digits (a bare "number" lets a model
# write decimals forever) that floating point checks exactly.
HALVES = {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("flag", _obj({"ok": {"type": "boolean"}})),
    ("enum", _obj({"color": {"enum": ["red", "green", "blue", "yellow"]}})),
    ("person", _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("date", _obj({"event": NAME, "on": {"type": "string", "format": "date"}})),
    (
        "email",
        _obj({"user": NAME, "email": {"type": "string", "format": "email", "maxLength": 40}}),
    ),
    (
        "tags",
        _obj({"title": TEXT, "tags": {"type": "array", "items": NAME, "maxItems": 4}}),
    ),
    (
        "optional",
        _obj(
            {
                "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                "note": TEXT,
                "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
            },
            required=["id"],
        ),
    ),
    (
        "address",
        _obj(
            {
                "name": NAME,
                "address": _obj(
                    {
                        "street": TEXT,
                        "city": NAME,
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    }
                ),
            },
        ),
    ),
    (
        "order",
        _obj(
            {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj(
                        {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}
                    ),
                },
                "status": {"enum": ["new", "paid", "shipped"]},
            },
        ),
    ),
    (
        "choice",
        {
            "anyOf": [
                _obj(
                    {
                        "kind": {"const": "circle"},
                        "radius": HALVES,
                    }
                ),
                _obj(
                    {
                        "kind": {"const": "square"},
                        "side": HALVES,
                    }
                ),
            ]
        },
    ),
    (
        "catalog",
        _obj(
            {
                "store": NAME,
                "products": {
                    "type": "array",
                    "maxItems": 3,
                    "items": _obj(
                        {
                            "name": NAME,
                            "price": {
                                "type": "number",
                                "minimum": 0,
                                "maximum": 1000,
                                "multipleOf": 0.25,
                            },
                            "in_stock": {"type": "boolean"},
                            "category": {"enum": ["food", "tools", "toys", "books"]},
                            "dims": _obj(
                                {
                                    "w": {"type": "integer", "minimum": 1, "maximum": 99},
                                    "h": {"type": "integer", "minimum": 1, "maximum": 99},
                                }
                            ),
                        }
                    ),
                },
                "open": {"type": "boolean"},
            },
        ),
    ),
]


def structured(
    n: int, input_len: int, output_len: int, times: Sequence[float], seed: int = 0
) -> list[RequestSpec]:
    """``n`` requests cycling through :data:`SCHEMAS` (unique prompts); every other one
    sampled with a seed (``temperature`` 0.8), the rest greedy."""
    rng = random.Random(seed)
    specs = []
    for i, t in enumerate(times[:n]):
        name, schema = SCHEMAS[i % len(SCHEMAS)]
        specs.append(
            RequestSpec(
                synthetic_prompt(input_len, rng),
                output_len,
                t,
                structured={"json": schema},
                label=name,
                seed=rng.randrange(1 << 30) if i % 2 else None,
            )
        )
    return specs


@dataclass(frozen=True)
class Validity:
    requests: int
    valid: int
    cut: int  # ended by max_tokens before the schema closed
    invalid: dict[str, int]  # by schema: ended but did not validate

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "valid": self.valid,
            "cut_by_max_tokens": self.cut,
            "invalid": self.invalid,
        }


def check(specs: Sequence[RequestSpec], results: Sequence[RequestResult]) -> Validity:
    """Each output against its request's schema."""
    import jsonschema

    schemas = dict(SCHEMAS)
    valid = cut = 0
    invalid: Counter[str] = Counter()
    for spec, r in zip(specs, results, strict=True):
        if spec.label is None or r.text is None:
            continue
        try:
            jsonschema.validate(json.loads(r.text), schemas[spec.label])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            if r.finish_reason == "length":
                cut += 1
            else:
                invalid[spec.label] += 1
    return Validity(len(results), valid, cut, dict(invalid))
