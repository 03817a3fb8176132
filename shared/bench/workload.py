"""What a benchmark sends and when: arrivals, synthetic prompts, trace replay, and
the shared-system-prompt and multi-turn generators.

Prompts are token ids of exact length (sent to ``/v1/completions``, which
vLLM, SGLang and Baton all accept), so input sizes are exact whatever the
tokenizer; outputs are forced (``ignore_eos``, ``max_tokens``).
"""

from __future__ import annotations

import csv
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import BatonError

TOKEN_LOW, TOKEN_HIGH = 1000, 30000  # plain word pieces in common vocabularies


class TraceFormatError(BatonError):
    """A trace file is missing, has the wrong columns, or a malformed row."""


@dataclass(frozen=True)
class RequestSpec:
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: float = 0.0  # seconds after the start (open loop)
    conversation: int | None = None  # multi-turn: which conversation, turn order = list order
    turn: int = 0  # multi-turn: 0 for the first turn
    think_s: float = 0.0  # multi-turn: the user's pause after the previous answer
    oracle_cached: int | None = None  # prefix traces: tokens an infinite cache would serve
    structured: dict[str, Any] | None = None  # sent as ``structured_outputs``
    label: str | None = None  # structured: which schema
    seed: int | None = None  # sampled with this seed at temperature 0.8 (None: greedy)
    chat: dict[str, Any] | None = None  # sent to chat completions: messages, tools, ...


def arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Start offsets of ``n`` requests: gamma-distributed gaps with mean ``1/rate``
    (``burstiness`` 1 = Poisson; < 1 burstier; > 1 more regular; inf = evenly spaced,
    a steady stream), as vLLM defines it. ``rate`` = inf sends everything at once."""
    if n <= 0:
        return []
    if not rate > 0:
        raise ValueError("the request rate must be positive")
    if not burstiness > 0:
        raise ValueError("burstiness must be positive")
    if np.isinf(rate):
        return [0.0] * n
    if np.isinf(burstiness):
        return [i / rate for i in range(n)]
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


def synthetic_prompt(length: int, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length))


def synthetic(
    n: int, input_len: int, output_len: int, times: Sequence[float], seed: int = 0
) -> list[RequestSpec]:
    rng = random.Random(seed)
    return [RequestSpec(synthetic_prompt(input_len, rng), output_len, t) for t in times[:n]]


def shared_prefix(
    n: int, prefix_len: int, suffix_len: int, output_len: int, times: Sequence[float], seed: int = 0
) -> list[RequestSpec]:
    """Every request starts with the same system prompt of ``prefix_len`` tokens."""
    rng = random.Random(seed)
    prefix = synthetic_prompt(prefix_len, rng)
    return [
        RequestSpec(prefix + synthetic_prompt(suffix_len, rng), output_len, t) for t in times[:n]
    ]


def multi_turn(
    conversations: int,
    turns: int,
    first_len: int,
    user_len: int,
    output_len: int,
    times: Sequence[float],
    seed: int = 0,
    think_s: float = 0.0,
) -> list[RequestSpec]:
    """Conversations whose turn ``k+1`` is sent a think time after turn ``k`` ends, with
    the whole history (previous prompt + the answer received) plus ``user_len`` new
    tokens; the spec holds the first turn's prompt, later turns only their new tokens.
    Think times are exponential with mean ``think_s`` (seeded)."""
    rng = random.Random(seed)
    out = []
    for c in range(conversations):
        at = times[c] if c < len(times) else 0.0
        for t in range(turns):
            prompt = synthetic_prompt(first_len if t == 0 else user_len, rng)
            think = rng.expovariate(1.0 / think_s) if think_s > 0 and t > 0 else 0.0
            out.append(RequestSpec(prompt, output_len, at, conversation=c, turn=t, think_s=think))
    return out


@dataclass(frozen=True)
class TraceRow:
    offset_s: float  # since the trace's first request
    context_tokens: int
    generated_tokens: int


TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def load_trace(path: Path) -> list[TraceRow]:
    """The Azure LLM inference trace 2023 format (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {path}: {exc}") from exc
    rows: list[TraceRow] = []
    with handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != TRACE_COLUMNS:
            raise TraceFormatError(
                f"{path}: expected the header {','.join(TRACE_COLUMNS)}, got {header}"
            )
        first: datetime | None = None
        for lineno, fields in enumerate(reader, start=2):
            if not fields:
                continue
            if len(fields) != 3:
                raise TraceFormatError(f"{path}:{lineno}: expected 3 fields, got {len(fields)}")
            try:
                when = datetime.fromisoformat(fields[0].strip()[:26])
                context, generated = int(fields[1]), int(fields[2])
            except ValueError as exc:
                raise TraceFormatError(f"{path}:{lineno}: {exc}") from None
            if context < 1 or generated < 0:
                raise TraceFormatError(f"{path}:{lineno}: token counts out of range")
            first = first or when
            offset = (when - first).total_seconds()
            if rows and offset < rows[-1].offset_s:
                raise TraceFormatError(f"{path}:{lineno}: timestamps go backwards")
            rows.append(TraceRow(offset, context, generated))
    if not rows:
        raise TraceFormatError(f"{path}: the trace has no requests")
    return rows


def from_trace(
    rows: Sequence[TraceRow],
    *,
    n: int,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    max_input: int = 4096,
    max_output: int = 512,
    seed: int = 0,
) -> list[RequestSpec]:
    """Replay the first ``n`` rows: arrival offsets divided by ``time_scale`` (< 1
    stretches the trace out, i.e. a lower request rate), token counts multiplied by
    ``token_scale`` and clamped, so a CPU can keep up with a production trace."""
    if time_scale <= 0 or token_scale <= 0:
        raise ValueError("time and token scales must be positive")
    rng = random.Random(seed)
    out = []
    for row in rows[:n]:
        ctx = max(1, min(max_input, round(row.context_tokens * token_scale)))
        gen = max(1, min(max_output, round(row.generated_tokens * token_scale)))
        out.append(RequestSpec(synthetic_prompt(ctx, rng), gen, row.offset_s / time_scale))
    return out
