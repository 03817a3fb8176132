"""Incremental detokenization with stop strings.

Text is released only when it is final: never a broken UTF-8 sequence (a
window that still decodes to U+FFFD at its end waits for more tokens), and
never a suffix that could still grow into a stop string. The concatenation of
all deltas equals the full decode of the same ids, cut before the first stop
string (OpenAI semantics: the stop string itself is not returned).
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.model.tokenizer import Tokenizer

# Re-decode this many tokens before the read position: byte-level BPE merges
# never need more context than this to render the newest token correctly.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, *, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything decoded so far (before stop-string truncation)
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0  # characters of self.text already returned
        self.stopped_by: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new ids; returns the text that became final."""
        if self.stopped_by is not None:
            return ""
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if full.endswith("\ufffd"):
            return self._release(final=False)  # an incomplete UTF-8 sequence: wait
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset = max(0, len(self.token_ids) - _CONTEXT_TOKENS)
        self._read_offset = len(self.token_ids)
        self._check_stop(old_len)
        return self._release(final=self.stopped_by is not None)

    def finish(self) -> str:
        """The sequence ended: flush what was held back."""
        if self.stopped_by is None:
            old_len = len(self.text)
            full = self._decode(self.token_ids)
            if len(full) > len(self.text) and full.startswith(self.text):
                self.text = full
            self._check_stop(old_len)
        return self._release(final=True)

    def _check_stop(self, old_len: int) -> None:
        best: int | None = None
        for s in self.stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx != -1 and (best is None or idx < best):
                best, self.stopped_by = idx, s
        if best is not None:
            self.text = self.text[:best]

    def _release(self, *, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._held_back()
        end = max(end, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
