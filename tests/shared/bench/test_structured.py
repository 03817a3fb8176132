"""The structured workload's requests and its check of outputs against schemas (pure
logic: results are built by hand, no server)."""

import json

import jsonschema

from shared.bench import structured
from shared.bench.metrics import RequestResult


def _result(text: str | None, finish: str = "stop") -> RequestResult:
    return RequestResult(8, 4, 0.0, (0.1,), 0.2, text=text, finish_reason=finish)


def test_schemas_are_valid_and_distinct() -> None:
    names = [name for name, _ in structured.SCHEMAS]
    assert len(names) >= 10 and len(set(names)) == len(names)
    for _, schema in structured.SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)


def test_requests_cycle_schemas_and_alternate_greedy_and_seeded() -> None:
    specs = structured.structured(24, 16, 64, [float(i) for i in range(24)], seed=3)
    assert [s.label for s in specs[:11]] == [n for n, _ in structured.SCHEMAS]
    assert all(s.structured == {"json": dict(structured.SCHEMAS)[s.label or ""]} for s in specs)
    assert [s.seed is None for s in specs[:4]] == [True, False, True, False]
    again = structured.structured(24, 16, 64, [float(i) for i in range(24)], seed=3)
    assert [s.seed for s in again] == [s.seed for s in specs]


def test_check_counts_valid_cut_and_invalid() -> None:
    specs = structured.structured(4, 8, 32, [0.0] * 4)
    flag, enum, person, date = specs
    results = [
        _result(json.dumps({"ok": True})),
        _result('{"color": "re', finish="length"),  # cut before the schema closed
        _result(json.dumps({"name": "x", "age": 500})),  # ended, out of range
        None,  # the request failed: neither valid nor invalid
    ]
    texts = [r if r is not None else _result(None) for r in results]
    v = structured.check([flag, enum, person, date], texts)
    assert (v.requests, v.valid, v.cut, v.invalid) == (4, 1, 1, {"person": 1})
