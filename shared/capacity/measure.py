"""``baton profile``: measure the engine on this machine into a :class:`Profile`.

- **Prefill**: one prompt of each length (fresh random tokens, so nothing is
  cached), generating one token: the time a prefill instance spends on it.
  The median of ``repeats`` runs, per thread count.
- **Decode**: ``batch`` requests whose prompts share all but their last token
  (the prefix cache makes setting up a batch cheap; each request still attends
  over its whole context), run until every one is decoding, then the median
  of ``steps`` timed steps, per thread count. Context is summed over the batch.
- **Transfer**: KV blocks sent over the chosen transport (UCX or TCP) between
  a listener and a connection in this process, ``transfer_mb`` MB in blocks of
  the model's block size: the loopback speed of the data plane the store uses.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import numpy as np

from shared.capacity.profile import DecodePoint, PrefillPoint, Profile
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.hardware import cpu_model
from shared.transport import make_transport
from shared.transport.base import Connection

Progress = Callable[[str], None]


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


def measure_prefill(
    engine: Engine, threads: int, tokens: Sequence[int], repeats: int, rng: random.Random
) -> list[PrefillPoint]:
    engine.set_num_threads(threads)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.generate([_prompt(rng, 32)], one)  # warm-up
    out = []
    for n in tokens:
        times = []
        for _ in range(repeats):
            prompt = _prompt(rng, n)
            t0 = time.perf_counter()
            engine.generate([prompt], one)
            times.append(time.perf_counter() - t0)
        out.append(PrefillPoint(threads, n, statistics.median(times)))
    return out


def measure_decode(
    engine: Engine,
    threads: int,
    batch: int,
    context: int,
    steps: int,
    rng: random.Random,
) -> DecodePoint:
    engine.set_num_threads(threads)
    shared = _prompt(rng, context - 1)
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    ids = [engine.add_request([*shared, rng.randrange(1000, 30000)], params) for _ in range(batch)]
    try:
        started: set[str] = set()
        while len(started) < batch:
            started |= {o.request_id for o in engine.step()}
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
    finally:
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    return DecodePoint(threads, batch, batch * (context + steps // 2), statistics.median(times))


async def measure_transfer(transport_name: str, block_bytes: int, total_mb: int) -> float:
    """Bytes per second of KV blocks sent over ``transport_name`` on this host."""
    transport = make_transport(transport_name)
    n = max(1, (total_mb << 20) // block_bytes)
    blocks = [np.ones(block_bytes, dtype=np.uint8) for _ in range(8)]
    sink = [np.empty(block_bytes, dtype=np.uint8) for _ in range(8)]
    done = asyncio.Event()

    async def serve(conn: Connection) -> None:
        got = 0
        while got < n:
            frame = await conn.recv()
            await conn.recv_segments(frame, sink[: len(frame.sizes)])
            got += len(frame.sizes)
        await conn.send(b"ok")
        done.set()

    listener = await transport.listen("127.0.0.1", 0, serve)
    try:
        conn = await transport.connect("127.0.0.1", listener.port)
        t0 = time.perf_counter()
        sent = 0
        while sent < n:
            k = min(8, n - sent)
            await conn.send(b"kv", blocks[:k])
            sent += k
        await conn.recv()
        seconds = time.perf_counter() - t0
        await conn.close()
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await listener.close()
        await transport.shutdown()
    return n * block_bytes / seconds


def measure(
    engine: Engine,
    *,
    threads: Sequence[int],
    prefill_tokens: Sequence[int] = (64, 128, 256, 512, 1024, 2048),
    decode_batches: Sequence[int] = (1, 4, 8, 16, 32, 64),
    decode_contexts: Sequence[int] = (128, 512, 1024),
    transport: str = "tcp",
    repeats: int = 3,
    steps: int = 6,
    transfer_mb: int = 64,
    progress: Progress = lambda _: None,
) -> Profile:
    rng = random.Random(0)
    saved = engine.config.num_threads or 1
    prefill: list[PrefillPoint] = []
    decode: list[DecodePoint] = []
    try:
        for t in threads:
            progress(f"prefill, {t} thread(s): {list(prefill_tokens)} tokens")
            prefill += measure_prefill(engine, t, prefill_tokens, repeats, rng)
            for ctx in decode_contexts:
                progress(f"decode, {t} thread(s), context {ctx}: batches {list(decode_batches)}")
                for b in decode_batches:
                    decode.append(measure_decode(engine, t, b, ctx, steps, rng))
    finally:
        engine.set_num_threads(saved)
    layout, groups = engine.layout, engine.kv_cache.groups
    progress(f"transfer over {transport}: {transfer_mb} MB")
    speed = asyncio.run(measure_transfer(transport, layout.block_bytes, transfer_mb))
    return Profile(
        model=engine.loaded.name,
        dtype=layout.dtype,
        cpu=cpu_model(),
        block_size=layout.block_size,
        kv_bytes_per_token=layout.bytes_per_token,
        transfer_bytes_s=speed,
        prefill=tuple(prefill),
        decode=tuple(decode),
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        notes={"transport": transport},
        kv_window=(groups.window or 0) if groups.windowed else 0,
        kv_window_bytes_per_token=groups.window_bytes_per_token(layout.bytes_per_token),
    )
