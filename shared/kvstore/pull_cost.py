"""Pull or recompute: a cost model fed by what this instance measures.

Loading ``n`` tokens of KV from the store costs about ``latency + bytes(n) /
bandwidth`` (``n * bytes_per_token``, less the sliding layers of the tokens
before the window where the pool keeps only the window's: see
:func:`shared.kv.layer_groups.load_bytes`); computing them costs ``n /
compute_rate``.
Both rates are moving averages of real transfers and prefill steps on this
machine, seeded with conservative guesses until the first measurements. A
load is worth it when it is cheaper than the compute it replaces (hidden
behind the layers still to compute, it is usually much cheaper); the
crossover is where the two meet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.kv.layer_groups import load_bytes

PullPolicy = Literal["auto", "always", "never"]
ALPHA = 0.2  # weight of a new measurement
MIN_LOAD_BYTES = 1 << 20  # smaller loads measure latency, not bandwidth
MIN_STEP_TOKENS = 64  # smaller steps are dominated by weight reads, not prefill compute


@dataclass
class PullCost:
    bytes_per_token: int
    policy: PullPolicy = "auto"
    bandwidth: float = 1e9  # bytes/s
    latency_s: float = 2e-3  # fixed cost of one load (lease, first round trips)
    compute_rate: float = 300.0  # prefill tokens/s
    block_size: int = 16
    window: int = 0  # tokens the sliding layers keep (0: every layer of every block loads)
    window_bytes_per_token: int = 0  # of bytes_per_token, the sliding layers'

    def load_bytes(self, tokens: int) -> int:
        return load_bytes(
            tokens, self.bytes_per_token, self.block_size, self.window, self.window_bytes_per_token
        )

    def pull_s(self, tokens: int) -> float:
        return self.latency_s + self.load_bytes(tokens) / self.bandwidth

    def compute_s(self, tokens: int) -> float:
        return tokens / self.compute_rate

    def worth_pulling(self, tokens: int) -> bool:
        if self.policy != "auto":
            return self.policy == "always"
        return tokens > 0 and self.pull_s(tokens) < self.compute_s(tokens)

    def crossover_tokens(self) -> float:
        """Fewest tokens for which pulling beats recomputing (inf: never): on the
        window's stretch every layer loads, past it only the full-attention ones."""
        per_token = 1.0 / self.compute_rate - self.bytes_per_token / self.bandwidth
        if per_token > 0 and (not self.window or self.latency_s / per_token <= self._stretch):
            return self.latency_s / per_token
        if not self.window:
            return float("inf")
        fixed = self.latency_s + self._stretch * self.window_bytes_per_token / self.bandwidth
        per_token += self.window_bytes_per_token / self.bandwidth
        return max(fixed / per_token, self._stretch) if per_token > 0 else float("inf")

    @property
    def _stretch(self) -> int:
        """Tokens of a load whose every layer moves."""
        return self.window + self.block_size

    def observe_load(self, nbytes: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if nbytes >= MIN_LOAD_BYTES:
            self.bandwidth += ALPHA * (nbytes / seconds - self.bandwidth)
        else:
            fixed = max(0.0, seconds - nbytes / self.bandwidth)
            self.latency_s += ALPHA * (fixed - self.latency_s)

    def observe_compute(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_STEP_TOKENS and seconds > 0:
            self.compute_rate += ALPHA * (tokens / seconds - self.compute_rate)
