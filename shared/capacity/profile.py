"""What the engine costs on one machine: step times measured by ``baton profile``.

A :class:`Profile` holds the measured points (prefill step time by prompt tokens,
decode step time by batch size and summed context, each per thread count, and
the KV transfer speed) and answers the simulator's questions from them:
prefill time by linear interpolation between the measured token counts
(extrapolated along the last segment), decode time from a least-squares fit
``a + b * batch + c * context`` per thread count. A thread count that was not
measured uses the nearest one measured below it (or the smallest).

Saved as JSON (``version`` 1); :func:`load` refuses another version or a
malformed file with a :class:`ProfileError` naming what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import BatonError
from shared.kv.layer_groups import load_bytes

VERSION = 1


class ProfileError(BatonError):
    """A profile file that cannot be used."""


@dataclass(frozen=True)
class PrefillPoint:
    threads: int
    tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodePoint:
    threads: int
    batch: int
    context: int  # tokens of context summed over the batch
    seconds: float


@dataclass(frozen=True)
class SideCpu:
    """CPU seconds that processes other than the engines spend on the same cores."""

    request_s: float = 0.0  # per request
    prompt_token_s: float = 0.0  # per prompt token (its KV through the store)
    output_token_s: float = 0.0  # per streamed token

    def seconds(self, requests: int, prompt_tokens: int, output_tokens: int) -> float:
        return (
            self.request_s * requests
            + self.prompt_token_s * prompt_tokens
            + self.output_token_s * output_tokens
        )


@dataclass(frozen=True)
class ServiceOverhead:
    """What serving adds to the engine's steps (see :mod:`shared.capacity.overhead`)."""

    request_s: float = 0.0  # per prompt, on top of its prefill compute
    step_s: float = 0.0  # per decode step
    token_s: float = 0.0  # per token of a decode step
    cluster: SideCpu = SideCpu()  # the gateway, the KV store and Redis
    client: SideCpu = SideCpu()  # a load generator on the same machine
    workers: SideCpu = SideCpu()  # prefill and decode processes, beyond the engine thread

    def decode_step_s(self, batch: int) -> float:
        return max(0.0, self.step_s + self.token_s * batch)

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> ServiceOverhead:
        """As :func:`dataclasses.asdict` wrote it; profiles older than ``cluster``,
        ``client`` or ``workers`` load with no CPU charged for them."""
        return cls(
            request_s=float(body.get("request_s", 0.0)),
            step_s=float(body.get("step_s", 0.0)),
            token_s=float(body.get("token_s", 0.0)),
            cluster=SideCpu(**body.get("cluster", {})),
            client=SideCpu(**body.get("client", {})),
            workers=SideCpu(**body.get("workers", {})),
        )


@dataclass(frozen=True)
class Profile:
    model: str
    dtype: str
    cpu: str
    block_size: int
    kv_bytes_per_token: int
    transfer_bytes_s: float
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    measured_at: str = ""
    notes: dict[str, str] = field(default_factory=dict)
    overhead: ServiceOverhead = ServiceOverhead()  # zero: engine times only
    # where the pool keeps its sliding layers' KV only for their window: the window
    # (tokens), and those layers' share of kv_bytes_per_token (0: no such layers)
    kv_window: int = 0
    kv_window_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ProfileError("a profile needs prefill and decode measurements")
        if self.transfer_bytes_s <= 0 or self.kv_bytes_per_token <= 0 or self.block_size <= 0:
            raise ProfileError("transfer speed, KV bytes per token and block size must be > 0")

    # -- the simulator's questions ----------------------------------------------------
    def load_bytes(self, tokens: int) -> int:
        """KV bytes a load of a ``tokens``-token prefix moves (see
        :func:`shared.kv.layer_groups.load_bytes`)."""
        return load_bytes(
            tokens,
            self.kv_bytes_per_token,
            self.block_size,
            self.kv_window,
            self.kv_window_bytes_per_token,
        )

    def prefill_seconds(self, tokens: int, threads: int) -> float:
        if tokens <= 0:
            return 0.0
        xs, ys = self._prefill_curve[_nearest(self._prefill_curve, threads)]
        if len(xs) == 1:
            return float(ys[0] * tokens / xs[0])
        if tokens <= xs[-1]:
            if tokens < xs[0]:  # below the first point: along the first segment, > 0
                slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
                return float(max(ys[0] - slope * (xs[0] - tokens), ys[0] * tokens / xs[0]))
            return float(np.interp(tokens, xs, ys))
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + slope * (tokens - xs[-1]))

    def decode_seconds(self, batch: int, context: int, threads: int) -> float:
        a, b, c = self._decode_fit[_nearest(self._decode_fit, threads)]
        return max(1e-4, a + b * batch + c * context)

    @cached_property
    def _prefill_curve(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        out = {}
        for t in sorted({p.threads for p in self.prefill}):
            pts = sorted((p.tokens, p.seconds) for p in self.prefill if p.threads == t)
            out[t] = (np.array([x for x, _ in pts], float), np.array([y for _, y in pts], float))
        return out

    @cached_property
    def _decode_fit(self) -> dict[int, tuple[float, float, float]]:
        out = {}
        for t in sorted({p.threads for p in self.decode}):
            pts = [p for p in self.decode if p.threads == t]
            a = np.array([[1.0, p.batch, p.context] for p in pts])
            y = np.array([p.seconds for p in pts])
            coef, *_ = np.linalg.lstsq(a, y, rcond=None)
            out[t] = (float(coef[0]), float(coef[1]), float(coef[2]))
        return out

    @property
    def threads(self) -> list[int]:
        return sorted({p.threads for p in self.prefill} & {p.threads for p in self.decode})

    # -- files --------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"version": VERSION, **asdict(self)}
        path.write_text(json.dumps(body, indent=1))


def load(path: Path) -> Profile:
    try:
        body = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from exc
    if not isinstance(body, dict) or body.get("version") != VERSION:
        raise ProfileError(f"{path}: not a version-{VERSION} Baton profile (run `baton profile`)")
    try:
        return Profile(
            model=str(body["model"]),
            dtype=str(body["dtype"]),
            cpu=str(body["cpu"]),
            block_size=int(body["block_size"]),
            kv_bytes_per_token=int(body["kv_bytes_per_token"]),
            transfer_bytes_s=float(body["transfer_bytes_s"]),
            prefill=tuple(PrefillPoint(**p) for p in body["prefill"]),
            decode=tuple(DecodePoint(**p) for p in body["decode"]),
            measured_at=str(body.get("measured_at", "")),
            notes=dict(body.get("notes", {})),
            overhead=ServiceOverhead.from_dict(body.get("overhead", {})),
            kv_window=int(body.get("kv_window", 0)),
            kv_window_bytes_per_token=int(body.get("kv_window_bytes_per_token", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{path}: malformed profile: {exc!r}") from exc


def _nearest(table: Mapping[int, object], threads: int) -> int:
    below = [t for t in table if t <= threads]
    return max(below) if below else min(table)
