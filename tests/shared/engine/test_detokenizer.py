from __future__ import annotations

import random

import pytest

from shared.engine.detokenizer import IncrementalDetokenizer
from shared.model.loader import LoadedModel
from shared.model.tokenizer import Tokenizer

TEXTS = [
    "Plain ASCII text, with punctuation!",
    "Accents: héllo wörld, façade, naïve café",
    "CJK 日本語のテキスト and 한국어 and 中文",
    "Emoji 😀🚀👩‍👩‍👧 sequences and flags 🇫🇷",
    "Code:\n\tdef f(x):\n\t\treturn x**2  # ok\n",
]


@pytest.fixture(scope="module")
def tok(loaded_fp32: LoadedModel) -> Tokenizer:
    return loaded_fp32.tokenizer


def stream(tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], str]:
    d = IncrementalDetokenizer(tok, stop=stop)
    deltas = [d.add([t]) for t in ids]
    deltas.append(d.finish())
    return deltas, "".join(deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas, joined = stream(tok, ids)
    assert joined == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_random_ids_never_emit_broken_utf8_and_match_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    byte_tokens = [i for i in range(tok.vocab_size) if len(tok.decode([i])) == 1][:2000]
    for _ in range(50):
        ids = [
            rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(tok.vocab_size)
            for _ in range(40)
        ]
        _, joined = stream(tok, ids)
        assert joined == tok.decode(ids)


def test_multibyte_char_split_over_tokens_waits(tok: Tokenizer) -> None:
    ids = tok.encode("🚀")
    assert len(ids) > 1  # the emoji is several byte tokens
    deltas, joined = stream(tok, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and joined == "🚀"


def test_stop_string_is_cut_and_not_returned(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 42. Done here.")
    _, joined = stream(tok, ids, stop=("Done",))
    assert joined == "The answer is 42. "


def test_possible_stop_prefix_is_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta gamma")
    d = IncrementalDetokenizer(tok, stop=("beta gam",))
    released = ""
    for t in ids:
        released += d.add([t])
        assert "beta" not in released  # never leaks a stop string in progress
    assert d.stopped_by == "beta gam"
    assert released + d.finish() == "alpha "


def test_held_back_text_is_released_when_no_stop_follows(tok: Tokenizer) -> None:
    ids = tok.encode("alpha bet")
    _, joined = stream(tok, ids, stop=("beta",))
    assert joined == "alpha bet"


def test_special_tokens_are_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>hello<|im_end|>")
    _, joined = stream(tok, ids)
    assert joined == "hello"
