"""Any prefix of a JSON object plus its closing parses as a JSON object (pure logic)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from shared.engine.json_closing import JsonCloser


def _value(rng: random.Random, depth: int) -> Any:
    kind = rng.choice(["obj", "arr", "str", "num", "lit"] if depth < 4 else ["str", "num", "lit"])
    if kind == "obj":
        return {f'k{i}\\"é': _value(rng, depth + 1) for i in range(rng.randint(0, 3))}
    if kind == "arr":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "str":
        return rng.choice(["", "a b", 'q"uote', "back\\slash", "é\u2028\u0001", "ok"])
    if kind == "num":
        return rng.choice([0, -1, 12, 3.5, -0.25, 1e-7, 6.02e23])
    return rng.choice([True, False, None])


def _closed(prefix: bytes) -> Any:
    closer = JsonCloser()
    closer.feed(prefix)
    closing = closer.closing()
    assert closing is not None, prefix
    return json.loads(prefix.decode(errors="ignore") + closing)


@pytest.mark.parametrize("seed", range(40))
def test_every_prefix_closes_into_an_object(seed: int) -> None:
    rng = random.Random(seed)
    obj = {"root": _value(rng, 0), "n": rng.randint(-9, 9)}
    texts = (
        json.dumps(obj, separators=(",", ":")),
        json.dumps(obj, indent=1),
        json.dumps(obj, ensure_ascii=False),
    )
    for text in texts:
        data = text.encode()
        for cut in range(len(data) + 1):
            if cut < len(data) and data[cut] & 0xC0 == 0x80:
                continue  # inside a UTF-8 character
            assert isinstance(_closed(data[:cut]), dict)
        assert _closed(data) == obj


def test_closings_are_the_shortest_sensible_ones() -> None:
    cases = {
        b"": "{}",
        b"{": "}",
        b'{"a":[1,': "null]}",
        b'{"a":{"b":tr': "ue}}",
        b'{"a":-': "0}",
        b'{"a":"x\\': 'n"}',
        b'{"a":"\\u00': '00"}',
        b'{"a":1,': '"":null}',
        b'{"ke': '":null}',
        b'{"a":[]}': "",
    }
    for prefix, closing in cases.items():
        closer = JsonCloser()
        closer.feed(prefix)
        assert closer.closing() == closing, prefix


def test_text_that_is_no_object_prefix_has_no_closing() -> None:
    for bad in (b"[1]", b'{"a" 1', b'{"a":1}}', b'{"a":nul!'):
        closer = JsonCloser()
        closer.feed(bad)
        assert closer.closing() is None, bad
