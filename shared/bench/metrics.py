"""Serving metrics with vLLM's serving-benchmark definitions (pure; unit-tested on
hand-made timelines).

Per request: TTFT = first chunk with choices - send; E2E = last chunk - send;
TPOT = (E2E - TTFT) / (output tokens - 1), defined for 2+ output tokens; ITL =
the gaps between consecutive chunks. Over a run: request throughput =
completed / duration, output (and total) token throughput likewise, goodput
= requests that met every SLO / duration (DistServe). Failed requests are
counted and reported, never dropped, and never count toward goodput.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RequestResult:
    prompt_tokens: int
    output_tokens: int
    start: float  # when the request was sent (seconds, any monotonic origin)
    chunk_times: tuple[float, ...]  # arrival of each chunk that carried choices
    end: float  # when the response ended (error or not)
    error: str | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    turn: int | None = None  # multi-turn: 0 for a conversation's first request
    oracle_cached: int | None = None  # prefix traces: what an infinite cache would serve
    text: str | None = None  # the output's text (kept for the structured workload's checks)
    finish_reason: str | None = None
    tool_calls: tuple[tuple[str, str], ...] | None = None  # chat: (name, arguments) each

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.ok else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] - self.start if self.ok else None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        if not self.ok:
            return []
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds; None = no bound on that metric."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``ttft=0.5,tpot=0.1,e2e=10`` (seconds; ``ms`` suffix allowed)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, raw = part.partition("=")
            if not sep or name not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"bad SLO {part!r}: expected ttft=, tpot= or e2e=")
            scale = 1e-3 if raw.endswith("ms") else 1.0
            try:
                value = float(raw.removesuffix("ms").removesuffix("s")) * scale
            except ValueError:
                raise ValueError(f"bad SLO value in {part!r}") from None
            if not value > 0:
                raise ValueError(f"SLO {name} must be positive")
            values[name] = value
        return cls(**values)

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        for bound, value in ((self.ttft, r.ttft), (self.tpot, r.tpot), (self.e2e, r.e2e)):
            if bound is not None and value is not None and value > bound:
                return False
        return True


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        a = np.asarray(values, dtype=np.float64)
        return cls(
            len(a),
            float(a.mean()),
            float(np.percentile(a, 50)),
            float(np.percentile(a, 90)),
            float(np.percentile(a, 99)),
        )


@dataclass(frozen=True)
class CacheSummary:
    """Prompt reuse the server reported, next to the infinite-cache oracle when known."""

    hit_rate: float  # cached prompt tokens / prompt tokens, completed requests
    oracle_hit_rate: float | None
    ttft_by_turn: dict[int, Distribution]  # multi-turn runs

    @property
    def of_oracle(self) -> float | None:
        if not self.oracle_hit_rate:
            return None
        return self.hit_rate / self.oracle_hit_rate

    @classmethod
    def of(cls, done: Sequence[RequestResult]) -> CacheSummary | None:
        reported = [r for r in done if r.cached_tokens is not None]
        if not reported:
            return None
        prompt = sum(r.prompt_tokens for r in reported)
        oracle = [r for r in reported if r.oracle_cached is not None]
        oracle_rate = (
            sum(r.oracle_cached or 0 for r in oracle) / sum(r.prompt_tokens for r in oracle)
            if oracle
            else None
        )
        turns = sorted({r.turn for r in done if r.turn is not None})
        by_turn = {
            t: Distribution.of([r.ttft for r in done if r.turn == t and r.ttft is not None])
            for t in turns
        }
        return cls(sum(r.cached_tokens or 0 for r in reported) / prompt, oracle_rate, by_turn)


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None  # requests/s meeting every SLO; None without SLOs
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    errors: dict[str, int]
    cache: CacheSummary | None = None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.cache is not None:
            out["cache"]["of_oracle"] = self.cache.of_oracle
        return out


def summarize(
    results: Sequence[RequestResult], duration_s: float, slo: SLO | None = None
) -> Summary:
    if duration_s <= 0:
        raise ValueError("the run's duration must be positive")
    done = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "no tokens").split(":")[0][:80]
            errors[key] = errors.get(key, 0) + 1
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    return Summary(
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration_s,
        request_throughput=len(done) / duration_s,
        output_throughput=out_tokens / duration_s,
        total_token_throughput=(out_tokens + in_tokens) / duration_s,
        goodput=None if slo is None else sum(slo.met(r) for r in results) / duration_s,
        ttft=Distribution.of([r.ttft for r in done if r.ttft is not None]),
        tpot=Distribution.of([r.tpot for r in done if r.tpot is not None]),
        itl=Distribution.of([g for r in done for g in r.itls]),
        e2e=Distribution.of([r.e2e for r in done if r.e2e is not None]),
        errors=errors,
        cache=CacheSummary.of(done),
    )
