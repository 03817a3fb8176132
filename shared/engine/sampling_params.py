"""Sampling parameters with OpenAI semantics, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.constraint import Constraint
from shared.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy. ``seed`` keys randomness by (seed, token position)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; n >= 0: the sampled token's plus top-n
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    constraint: Constraint | None = None  # what the output must match (structured outputs)

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad("max_tokens must be an integer")
        if self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise bad(f"top_k must be >= 1 when given, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {value}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise bad("stop strings must be non-empty")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise bad(f"logit_bias entries must be token id >= 0 -> [-100, 100], got {token}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed must fit in 64 bits")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, a logit bias or an output constraint change the logits before
        sampling."""
        return self.has_penalties or bool(self.logit_bias) or self.constraint is not None
