"""Attainment of the cluster's latency targets (:class:`shared.config.SloConfig`).

The gateway judges every request it finished against the targets
(:class:`SloWindow`), counts the outcomes in its metrics, and publishes the last
minute's attainment to Redis (:func:`publish`, a key with a TTL, refreshed while it
runs) so that ``baton status`` and the status page read the same figures.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from shared.cluster.keys import Keys
from shared.config import SloConfig

WINDOW_S = 60.0  # attainment is reported over the last minute


@dataclass(frozen=True)
class Verdict:
    """One request against the targets: whether each was met (None: no such target)."""

    ttft: bool | None
    tpot: bool | None

    @property
    def both(self) -> bool:
        return self.ttft is not False and self.tpot is not False


def judge(slo: SloConfig, ttft_s: float | None, tpot_s: float | None) -> Verdict:
    """``ttft_s`` None: the request produced no token (it misses a TTFT target);
    ``tpot_s`` None: at most one output token (no TPOT to miss)."""
    ttft = None if slo.ttft_s is None else ttft_s is not None and ttft_s <= slo.ttft_s
    tpot = None if slo.tpot_s is None else ttft_s is not None and (tpot_s or 0.0) <= slo.tpot_s
    return Verdict(ttft, tpot)


@dataclass(frozen=True)
class Attainment:
    """Requests judged in the window and the share of them that met each target
    (None: no target, or no request)."""

    ttft_s: float | None
    tpot_s: float | None
    window_s: float
    requests: int
    ttft_met: float | None
    tpot_met: float | None
    both_met: float | None

    def describe(self) -> str:
        targets = [
            f"{name} <= {value:g} s"
            for name, value in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s))
            if value is not None
        ]
        head = "SLO " + (", ".join(targets) if targets else "not set")
        if not targets:
            return head
        if not self.requests:
            return f"{head}: no request in the last {self.window_s:g} s"
        parts = [f"{self.both_met:.0%} met both"]
        parts += [
            f"{name} {share:.0%}"
            for name, share in (("TTFT", self.ttft_met), ("TPOT", self.tpot_met))
            if share is not None
        ]
        return (
            f"{head}: last {self.window_s:g} s, {self.requests} requests, {parts[0]} "
            f"({', '.join(parts[1:])})"
        )


class SloWindow:
    """Verdicts of the last :data:`WINDOW_S` seconds. Owned by the gateway's metrics;
    used on the event loop only."""

    def __init__(self, targets: SloConfig, window_s: float = WINDOW_S):
        self.targets = targets
        self.window_s = window_s
        self._items: deque[tuple[float, Verdict]] = deque()

    def record(self, verdict: Verdict, now: float | None = None) -> None:
        self._items.append((time.monotonic() if now is None else now, verdict))

    def attainment(self, now: float | None = None) -> Attainment:
        now = time.monotonic() if now is None else now
        while self._items and self._items[0][0] < now - self.window_s:
            self._items.popleft()
        verdicts = [v for _, v in self._items]
        n = len(verdicts)

        def share(met: list[bool | None]) -> float | None:
            judged = [m for m in met if m is not None]
            return sum(judged) / len(judged) if judged else None

        return Attainment(
            ttft_s=self.targets.ttft_s,
            tpot_s=self.targets.tpot_s,
            window_s=self.window_s,
            requests=n,
            ttft_met=share([v.ttft for v in verdicts]),
            tpot_met=share([v.tpot for v in verdicts]),
            both_met=share([v.both for v in verdicts]) if self.targets.is_set else None,
        )


async def publish(redis: aioredis.Redis, keys: Keys, attainment: Attainment, ttl_s: float) -> None:
    """Writes the gateway's attainment, kept ``ttl_s`` unless published again."""
    await redis.set(keys.slo(), json.dumps(asdict(attainment)), px=max(1, int(ttl_s * 1000)))


async def read(redis: aioredis.Redis, keys: Keys) -> Attainment | None:
    """The latest attainment a live gateway published (None: none, or no targets)."""
    raw = await redis.get(keys.slo())
    if raw is None:
        return None
    return Attainment(**json.loads(raw))
