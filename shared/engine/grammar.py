"""Grammars for constrained decoding, through llguidance.

Why llguidance (PyPI ``llguidance``): it has no dependencies (one abi3 wheel of
Rust, no torch, transformers or Triton, so the gateway can check a schema with the
same code the engine runs), computes a token mask for this vocabulary in ~20 us on
one core with no per-schema precompilation (a JSON schema's matcher is built in well
under a millisecond), covers JSON Schema broadly (nested objects, arrays, enums,
``anyOf``, string formats and patterns) plus regexes and Lark grammars, and is what
vLLM's ``guidance`` backend and llama.cpp use. xgrammar needs torch, transformers and
Triton; outlines-core builds an index per schema that grows with it.

:class:`GrammarCompiler` owns the tokenizer's llguidance view (built once, ~0.2 s,
on first use) and a cache of compiled matchers by :class:`Constraint`; it is
thread-safe. A :class:`Matcher` is one request's position in its grammar: the
engine thread advances it with every token the request's output takes, on
whichever instance that happens, so a matcher rebuilt from the constraint and the
tokens so far (prefill's first token, a failover's replay) is in the same state.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shared.engine.constraint import Constraint
from shared.engine.json_closing import JsonCloser
from shared.errors import InvalidRequestError

if TYPE_CHECKING:
    import llguidance
    import numpy as np  # the engine's mask rows; the gateway checks schemas without numpy

# JSON as OpenAI's structured outputs writes it: no free whitespace between tokens (a
# small model can otherwise fill max_tokens with newlines)
JSON_DEFAULTS = {"whitespace_flexible": False}
CACHED_GRAMMARS = 256
# json_object: how near the end of its budget an output starts checking that it can still
# close (a closing longer than this, 60-odd levels deep, is not written)
FORCE_WINDOW = 64


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # the dependency is declared; a broken install is a 400
        raise InvalidRequestError(
            "constrained decoding needs the llguidance package, which is not installed"
        ) from exc
    return llguidance


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar for ``constraint``; InvalidRequestError when its spec does
    not parse (a schema that is not JSON, an empty choice list)."""
    llg = _llguidance()
    matcher = llg.LLMatcher
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json_schema":
            return str(matcher.grammar_from_json_schema(json.loads(spec), defaults=JSON_DEFAULTS))
        if kind == "json_object":
            return str(matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS))
        if kind == "regex":
            return str(matcher.grammar_from_regex(spec))
        if kind == "choice":
            options = json.loads(spec)
            if not options or not all(isinstance(o, str) and o for o in options):
                raise InvalidRequestError("choice needs one or more non-empty strings")
            alternatives = " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
            return str(matcher.grammar_from_lark(f"start: {alternatives}"))
        return str(matcher.grammar_from_lark(spec))
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise InvalidRequestError(f"invalid {kind}: {exc}") from exc


class Matcher:
    """One request's state in its grammar (engine thread only).

    A ``json_object`` matcher that knows the request's output budget (``budget``:
    tokens it may write) also follows the object's structure, and keeps the object
    closable in the tokens left (:meth:`within_budget`)."""

    def __init__(
        self,
        inner: llguidance.LLMatcher,
        constraint: Constraint,
        vocab_size: int,
        tokenizer: Any = None,
        budget: int | None = None,
    ):
        self._m = inner
        self.constraint = constraint
        self.mask_words = -(-vocab_size // 32)  # a mask's length in 32-bit words
        self._tokenizer = tokenizer
        self._budget = budget if budget is not None else 0
        closes = constraint.kind == "json_object" and tokenizer is not None and budget
        self._closer = JsonCloser() if closes else None
        self._taken = 0  # output tokens so far
        self.closed_early = False  # the latest token was written to close in time

    def fill_mask(self, bitmask_row: np.ndarray) -> None:
        """The tokens allowed next, as bits (1 = allowed) into a contiguous uint32 row of
        ``ceil(vocab / 32)`` words (any thread; the matcher must not move meanwhile)."""
        if not bitmask_row.flags.c_contiguous or bitmask_row.dtype.str != "<u4":
            raise ValueError("a mask row is a contiguous uint32 array")
        self._m.unsafe_compute_mask_ptr(bitmask_row.ctypes.data, bitmask_row.nbytes)

    def within_budget(self, token: int) -> int:
        """The sampled ``token``, or, when the object could no longer be closed in the
        tokens left after it, the first token of the shortest closing of what is written
        (json_closing.py). A function of the tokens so far and the sampled one, so every
        instance (and a request resumed anywhere) writes the same."""
        self.closed_early = False
        left = self._budget - self._taken
        if self._closer is None or left > FORCE_WINDOW:
            return token
        after = self._closer.copy()
        after.feed(self._tokenizer.decode_bytes([token]))
        if self._closing_tokens(after, left - 1) is not None:
            return token
        closing = self._closing_tokens(self._closer, left)
        if not closing or self._m.validate_tokens(closing[:1]) != 1:
            return token  # cannot close in time: the output is cut, as it would be
        self.closed_early = True
        return int(closing[0])

    def _closing_tokens(self, closer: JsonCloser, at_most: int) -> list[int] | None:
        """Tokens of ``closer``'s closing when they number at most ``at_most``."""
        text = closer.closing()
        if text is None:
            return None
        tokens: list[int] = self._tokenizer.tokenize_str(text) if text else []
        return tokens if len(tokens) <= at_most else None

    def accept(self, token: int) -> bool:
        """Advance by one token of the output; False (and an error state) when the
        grammar does not allow it."""
        if not self._m.consume_token(token):
            return False
        self._taken += 1
        if self._closer is not None:
            self._closer.feed(self._tokenizer.decode_bytes([token]))
        return True

    def replay(self, tokens: Sequence[int]) -> None:
        """Advance by tokens produced elsewhere; InvalidRequestError if they do not fit."""
        if tokens and not self._m.consume_tokens(list(tokens)):
            raise InvalidRequestError(
                f"the generated tokens do not match the {self.constraint.kind} constraint: "
                f"{self._m.get_error()}"
            )
        self._taken += len(tokens)
        if self._closer is not None and tokens:
            self._closer.feed(self._tokenizer.decode_bytes(list(tokens)))

    @property
    def cut_by_budget(self) -> bool:
        """A json_object closed because the budget ran out: its last token was written
        to close in time, or the object ends on the budget's last token."""
        return self._closer is not None and (self.closed_early or self._taken >= self._budget)

    @property
    def done(self) -> bool:
        """The grammar ended: nothing but the end of the output may follow."""
        return bool(self._m.is_stopped())

    @property
    def failed(self) -> bool:
        return bool(self._m.is_error())


class GrammarCompiler:
    """Checks constraints and makes matchers for one tokenizer (thread-safe)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: Any = None
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            llg = _llguidance()
            self._tokenizer = llg.LLTokenizer(
                self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos
            )
        return self._tokenizer

    def compile(self, constraint: Constraint) -> None:
        """Check ``constraint`` and keep its compiled matcher; InvalidRequestError naming
        the problem when it cannot be used (a bad schema, an unsupported keyword)."""
        self._template(constraint)

    def matcher(self, constraint: Constraint, budget: int | None = None) -> Matcher:
        """A fresh matcher at the start of the constraint's grammar; ``budget``: the
        output tokens the request may write (a json_object closes within it)."""
        template = self._template(constraint)
        return Matcher(
            template.deep_copy(), constraint, self._vocab_size, self._llg_tokenizer(), budget
        )

    def _template(self, constraint: Constraint) -> Any:
        with self._lock:
            found = self._compiled.get(constraint)
            if found is not None:
                self._compiled.move_to_end(constraint)
                return found
            tokenizer = self._llg_tokenizer()
        grammar = grammar_text(constraint)
        llg = _llguidance()
        error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidRequestError(f"invalid {constraint.kind}: {error}")
        # log_level 0: a refused token is reported by the caller, not printed to stderr
        compiled = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise InvalidRequestError(f"invalid {constraint.kind}: {compiled.get_error()}")
        with self._lock:
            self._compiled[constraint] = compiled
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled
