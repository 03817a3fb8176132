"""Prefix-hash traces: the open format in which production systems publish prompt reuse.

One JSON object per line (Mooncake's published traces use it):
``{"timestamp": ms since start, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}`` with one hash id per block of ``block_tokens`` prompt
tokens (512 in Mooncake's traces); equal ids mean equal blocks, and ids are
chained (an id also names everything before it), so two requests share a
prefix exactly as far as their id lists agree.

:func:`replay` synthesises token ids from the hash ids (every id always gives
the same tokens), so the reuse a server sees is the reuse the trace recorded.
Each request also carries the infinite-cache oracle: how many of its tokens
a cache that never evicts could have served (the prefix of ids seen in
earlier requests, counted in whole cache blocks, the last prompt token always
computed), against which a server's reported ``cached_tokens`` are read.
:func:`synthesize` writes a small trace of the same shape for tests and local
runs: shared system prompts, multi-turn sessions that grow, one-off prompts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.bench.workload import TOKEN_HIGH, TOKEN_LOW, RequestSpec, TraceFormatError


@dataclass(frozen=True)
class PrefixTraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def as_json(self) -> str:
        return json.dumps(
            {
                "timestamp": self.timestamp_ms,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": list(self.hash_ids),
            }
        )


def load(path: Path) -> list[PrefixTraceRow]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {path}: {exc}") from exc
    rows: list[PrefixTraceRow] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            row = PrefixTraceRow(
                float(obj["timestamp"]),
                int(obj["input_length"]),
                int(obj["output_length"]),
                tuple(int(h) for h in obj["hash_ids"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceFormatError(f"{path}:{lineno}: not a prefix-trace row ({exc})") from None
        if row.input_length < 1 or row.output_length < 0:
            raise TraceFormatError(f"{path}:{lineno}: token counts out of range")
        if rows and row.timestamp_ms < rows[-1].timestamp_ms:
            raise TraceFormatError(f"{path}:{lineno}: timestamps go backwards")
        rows.append(row)
    if not rows:
        raise TraceFormatError(f"{path}: the trace has no requests")
    return rows


def write(path: Path, rows: Iterable[PrefixTraceRow]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r.as_json() + "\n" for r in rows))


def _block_tokens(hash_id: int, n: int, seed: int) -> list[int]:
    rng = random.Random(f"{seed}:{hash_id}")
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def replay(
    rows: Sequence[PrefixTraceRow],
    *,
    n: int,
    block_tokens: int,
    cache_block: int = 16,
    time_scale: float = 1.0,
    max_input: int = 4096,
    max_output: int = 512,
    seed: int = 0,
) -> list[RequestSpec]:
    """The first ``n`` rows as requests (arrivals divided by ``time_scale``), each with
    its infinite-cache oracle in ``oracle_cached``."""
    if time_scale <= 0 or block_tokens < 1 or cache_block < 1:
        raise ValueError("time scale and block sizes must be positive")
    seen: set[tuple[int, ...]] = set()
    out = []
    for i, row in enumerate(rows[:n]):
        length = min(row.input_length, max_input)
        prompt: list[int] = []
        for h in row.hash_ids:
            if len(prompt) >= length:
                break
            prompt += _block_tokens(h, block_tokens, seed)
        if len(prompt) < length:  # ids cover less than the stated length: unique filler
            prompt += _block_tokens(-1 - i, length - len(prompt), seed)
        prompt = prompt[:length]
        ids = row.hash_ids[: -(-length // block_tokens)]
        shared = 0
        while shared < len(ids) and ids[: shared + 1] in seen:
            shared += 1
        seen.update(ids[: k + 1] for k in range(len(ids)))
        reusable = min(shared * block_tokens, length - 1)
        out.append(
            RequestSpec(
                tuple(prompt),
                max(1, min(max_output, row.output_length)),
                row.timestamp_ms / 1000.0 / time_scale,
                oracle_cached=reusable // cache_block * cache_block,
            )
        )
    return out


def synthesize(
    n: int,
    *,
    block_tokens: int = 64,
    rate: float = 1.0,
    system_prompts: int = 3,
    system_blocks: int = 8,
    session_share: float = 0.5,
    new_blocks: tuple[int, int] = (1, 4),
    output_length: tuple[int, int] = (16, 64),
    seed: int = 0,
) -> list[PrefixTraceRow]:
    """A trace of ``n`` requests arriving as a Poisson process at ``rate`` per second.
    Every request starts with one of ``system_prompts`` shared prefixes; a share
    ``session_share`` continue an earlier request's conversation (its ids plus its
    answer's and new ones), the rest start a new one."""
    rng = random.Random(seed)
    next_id = iter(range(10**9))
    systems = [tuple(next(next_id) for _ in range(system_blocks)) for _ in range(system_prompts)]
    sessions: list[tuple[tuple[int, ...], int]] = []  # (ids, output length)
    rows = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate) * 1000.0
        if sessions and rng.random() < session_share:
            base, answered = sessions.pop(rng.randrange(len(sessions)))
            grown = answered // block_tokens  # the answer's whole blocks join the history
            ids = base + tuple(next(next_id) for _ in range(grown))
        else:
            ids = systems[rng.randrange(len(systems))]
        ids += tuple(next(next_id) for _ in range(rng.randint(*new_blocks)))
        out_len = rng.randint(*output_length)
        rows.append(PrefixTraceRow(round(t, 3), len(ids) * block_tokens, out_len, ids))
        sessions.append((ids, out_len))
    return rows
