"""Failures injected into a running local cluster while it streams, and what the
client saw: the harness of ``benchmarks/failover_bench.py`` and of the failover tests.

- :func:`stream` sends one streamed completion (greedy or seeded) and stamps
  every token the client receives.
- :class:`SteadyLoad` keeps ``concurrency`` streams going until stopped
  (rolling restarts, store and Redis outages happen under it).
- :func:`apply_fault` kills (SIGKILL), hangs (SIGSTOP) or drains (SIGTERM) one
  instance; :func:`busiest` picks the decode instance with the most streams.
- :func:`with_fault` and :func:`under_load` run a scenario; :func:`rolling_restart`,
  :func:`kill_instance` and :func:`redis_outage` are the scenarios run under load.
- :class:`Supervised` restarts what dies, as ``baton up`` does.
- :func:`reference` computes what a failure-free run gives, in one process.

Every check compares token ids: a stream with an error, a missing or a
duplicated token is a broken stream.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import httpx
import redis

from shared.bench.scrape import metric_sum
from shared.cluster.keys import Keys
from shared.engine.constraint import Constraint
from shared.engine.sampling_params import SamplingParams
from shared.launcher import LocalCluster
from shared.supervisor import RestartPolicy, Supervisor, SupervisorThread

if TYPE_CHECKING:
    from shared.engine.engine import Engine

Fault = Literal["kill", "stop", "term"]
# the gateway's failover reasons each fault shows as (a stopped instance: its streams go
# silent, or, later, it leaves membership)
FAULT_REASONS: dict[Fault, tuple[str, ...]] = {
    "kill": ("lost",),
    "stop": ("stalled", "hung"),
    "term": ("migrated",),
}


def failovers(url: str, fault: Fault) -> float:
    """The gateway's failovers so far of the kinds ``fault`` causes."""
    return sum(
        metric_sum(url, "baton_failovers_total", f'reason="{r}"') for r in FAULT_REASONS[fault]
    )


@dataclass(frozen=True)
class ChaosRequest:
    prompt: list[int]
    max_tokens: int
    seed: int | None  # None: greedy
    json_schema: dict[str, Any] | None = None  # the output constrained to this schema
    ignore_eos: bool = True  # False: it may end early, as an API without the option does

    def params(self) -> SamplingParams:
        constraint = None if self.json_schema is None else Constraint.json_schema(self.json_schema)
        if self.seed is None:
            return SamplingParams(
                max_tokens=self.max_tokens, temperature=0.0, ignore_eos=self.ignore_eos,
                constraint=constraint,
            )  # fmt: skip
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=0.8, top_p=0.95, seed=self.seed,
            ignore_eos=self.ignore_eos, constraint=constraint,
        )  # fmt: skip

    def body(self, model: str) -> dict[str, object]:
        body: dict[str, object] = {
            "model": model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "stream": True,
            "return_token_ids": True,
            "temperature": 0.0 if self.seed is None else 0.8,
        }
        if self.seed is not None:
            body |= {"seed": self.seed, "top_p": 0.95}
        if self.json_schema is not None:
            body["structured_outputs"] = {"json": self.json_schema}
        return body


def make_requests(
    rng: random.Random, n: int, *, prompt_len: tuple[int, int], max_tokens: int
) -> list[ChaosRequest]:
    """``n`` unique prompts; every other one sampled with a seed, the rest greedy."""
    return [
        ChaosRequest(
            [rng.randrange(1000, 30000) for _ in range(rng.randint(*prompt_len))],
            max_tokens,
            rng.randrange(1 << 30) if i % 2 else None,
        )
        for i in range(n)
    ]


@dataclass
class StreamResult:
    request: ChaosRequest
    started: float
    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # perf_counter when each token arrived
    error: str | None = None
    ended: float = 0.0

    def first_after(self, t: float) -> float | None:
        return next((s for s in self.stamps if s > t), None)

    def active_at(self, t: float) -> bool:
        return bool(self.stamps) and self.stamps[0] <= t and self.ended > t


async def stream(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    req: ChaosRequest,
    on_tokens: Callable[[int], None] = lambda n: None,
) -> StreamResult:
    out = StreamResult(req, time.perf_counter())
    try:
        async with http.stream("POST", url + "/v1/completions", json=req.body(model)) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"])
                    break
                now = time.perf_counter()
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    out.tokens += ids
                    out.stamps += [now] * len(ids)
                    on_tokens(len(ids))
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.ended = time.perf_counter()
    return out


class SteadyLoad:
    """``concurrency`` clients, each sending the next request as soon as its last ended."""

    def __init__(
        self, http: httpx.AsyncClient, url: str, model: str, requests: Iterator[ChaosRequest],
        concurrency: int,
    ):  # fmt: skip
        self.http, self.url, self.model = http, url, model
        self.requests = requests
        self.results: list[StreamResult] = []
        self.tokens = 0
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client()) for _ in range(concurrency)]

    def _count(self, n: int) -> None:
        self.tokens += n

    async def _client(self) -> None:
        while not self._stop.is_set():
            req = next(self.requests, None)
            if req is None:
                return
            self.results.append(await stream(self.http, self.url, self.model, req, self._count))

    async def wait_tokens(self, n: int, timeout_s: float = 120.0) -> None:
        target = self.tokens + n
        deadline = time.monotonic() + timeout_s
        while self.tokens < target and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> list[StreamResult]:
        """Let every stream in flight finish; send no more."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.results


def instance_stats(local: LocalCluster, name: str) -> dict[str, float] | None:
    spec = next(s for s in local.specs if s.name == name)
    try:
        r = httpx.get(f"http://127.0.0.1:{spec.http_port}/stats", timeout=2)
        return dict(r.json())
    except (httpx.HTTPError, ValueError):
        return None


def busiest(local: LocalCluster, role: str = "decode") -> str:
    """The live instance of ``role`` with the most requests right now."""
    best, most = "", -1.0
    for spec in local.specs:
        if spec.role != role or not local.procs[spec.name].alive:
            continue
        stats = instance_stats(local, spec.name)
        n = float(stats.get("requests", 0)) if stats else -1.0
        if n > most:
            best, most = spec.name, n
    return best


def is_ready(local: LocalCluster, name: str) -> bool:
    spec = next(s for s in local.specs if s.name == name)
    try:
        return httpx.get(f"http://127.0.0.1:{spec.http_port}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(local: LocalCluster, role: str, timeout_s: float = 120.0) -> None:
    """Every instance of ``role`` answers ready (a restarted one included)."""
    deadline = time.monotonic() + timeout_s
    for spec in local.specs:
        if spec.role != role:
            continue
        while not is_ready(local, spec.name):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{spec.name} not ready within {timeout_s:.0f}s")
            time.sleep(0.2)


def settle(local: LocalCluster) -> None:
    """Every store, prefill and decode instance ready, and the gateway knows it."""
    for role in ("kvstore", "prefill", "decode"):
        wait_ready(local, role)
    time.sleep(1.0)  # the gateway's membership view catches up


def apply_fault(local: LocalCluster, name: str, fault: Fault) -> Callable[[], None]:
    """Kill, hang or drain ``name``; returns what ends a hang (the hung process is
    woken and killed, so the supervisor restarts it), a no-op otherwise."""
    proc = local.procs[name].proc
    if proc is None:
        raise RuntimeError(f"{name} is not running")
    if fault == "kill":
        proc.kill()
    elif fault == "stop":
        proc.send_signal(signal.SIGSTOP)

        def end_hang() -> None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()

        return end_hang
    else:
        proc.send_signal(signal.SIGTERM)
    return lambda: None


class Streamed(Protocol):
    """A stream's outcome as the checks read it (plain or resumable)."""

    request: ChaosRequest
    tokens: list[int]
    error: str | None


def broken(results: Sequence[Streamed], expected: list[list[int]]) -> list[str]:
    """One line per stream that failed or differs from the failure-free tokens."""
    out = []
    for i, (r, want) in enumerate(zip(results, expected, strict=True)):
        if r.error is not None:
            out.append(f"stream {i}: {r.error}")
        elif r.tokens != want:
            first = next(
                (j for j, (a, b) in enumerate(zip(r.tokens, want, strict=False)) if a != b),
                min(len(r.tokens), len(want)),
            )
            out.append(f"stream {i}: {len(r.tokens)} tokens, differs from token {first}")
    return out


def reference(engine: Engine, requests: list[ChaosRequest], batch: int = 4) -> list[list[int]]:
    """The tokens of a failure-free run in one process. Requests run ``batch`` at a time:
    a row's result does not depend on its batch (the engine's invariance, tested on its
    own in tests/shared/engine/test_engine.py), so this equals each request alone, and a
    long load's reference takes a fraction of the time."""
    out: list[list[int]] = []
    for i in range(0, len(requests), batch):
        chunk = requests[i : i + batch]
        done = engine.generate([r.prompt for r in chunk], [r.params() for r in chunk])
        out += [c.token_ids for c in done]
    return out


class Supervised:
    """A local cluster whose dead children (and Redis) a supervisor thread restarts;
    ``close`` ends the supervision (before the cluster stops)."""

    def __init__(self, local: LocalCluster, say: Callable[[str], None] = lambda m: None):
        self.local = local
        policy = RestartPolicy(max_restarts=100)
        self._thread = SupervisorThread(Supervisor(local, policy, say=say)).start()

    def pause(self) -> None:
        self._thread.hold()
        self._raise()

    def resume(self) -> None:
        self._raise()
        self._thread.release()

    def close(self) -> None:
        self._thread.stop()
        self._raise()

    def _raise(self) -> None:
        if self._thread.error is not None:
            raise self._thread.error


@dataclass
class FaultRun:
    results: list[StreamResult]
    at: float  # perf_counter when the fault was applied
    victim: str

    def gaps(self) -> list[float]:
        """Per stream in flight at the fault: the longest wait for a token from the fault
        on (the resume gap of a stream that failed over; an inter-token time otherwise)."""
        out = []
        for r in self.results:
            if r.started > self.at or r.ended < self.at:
                continue
            times = [self.at, *(s for s in r.stamps if s > self.at)]
            if len(times) > 1:
                out.append(max(b - a for a, b in itertools.pairwise(times)))
        return out


async def with_fault(
    local: LocalCluster, model: str, requests: list[ChaosRequest], fault: Fault,
    after_tokens: int = 3,
) -> FaultRun:  # fmt: skip
    """Stream ``requests`` at once; once each made about ``after_tokens`` tokens, apply
    ``fault`` to the busiest decode instance."""
    flowing = [0]

    def count(n: int) -> None:
        flowing[0] += n

    async with httpx.AsyncClient(timeout=600) as http:
        tasks = [
            asyncio.create_task(stream(http, local.gateway_url, model, r, count)) for r in requests
        ]
        deadline = time.monotonic() + 120
        while flowing[0] < after_tokens * len(requests) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        victim = await asyncio.to_thread(busiest, local)
        at = time.perf_counter()
        end_hang = apply_fault(local, victim, fault)
        try:
            return FaultRun(list(await asyncio.gather(*tasks)), at, victim)
        finally:
            end_hang()


async def under_load(
    local: LocalCluster, model: str, requests: Iterator[ChaosRequest], concurrency: int,
    during: Callable[[], Awaitable[None]],
) -> list[StreamResult]:  # fmt: skip
    """Run ``during`` while ``concurrency`` streams keep going; every stream's result."""
    async with httpx.AsyncClient(timeout=600) as http:
        load = SteadyLoad(http, local.gateway_url, model, requests, concurrency)
        await load.wait_tokens(3 * concurrency)
        await during()
        return await load.stop()


async def rolling_restart(local: LocalCluster, roles: tuple[str, ...] = ("decode",)) -> None:
    """Drain (SIGTERM) each instance of ``roles`` in turn; the next once the supervisor
    restarted the last one and it is ready."""
    for spec in [s for role in roles for s in local.specs if s.role == role]:
        old = local.procs[spec.name].proc
        apply_fault(local, spec.name, "term")
        while local.procs[spec.name].proc is old:  # drained, exited, restarted
            await asyncio.sleep(0.2)
        await asyncio.to_thread(wait_ready, local, spec.role)


async def kill_instance(local: LocalCluster, name: str, hold_s: float) -> None:
    """SIGKILL ``name`` and keep the load going ``hold_s`` (it is still listed a while)."""
    apply_fault(local, name, "kill")
    await asyncio.sleep(hold_s)


async def redis_outage(
    cluster: Supervised, down_s: float, members: int, timeout_s: float = 30.0
) -> dict[str, float]:
    """Kill Redis and keep it down ``down_s`` (the supervisor paused), then start it
    again, empty; returns seconds from its return until ``members`` instances
    re-registered, the prompt index had entries again and a watermark was written."""
    local = cluster.local
    if local.redis.proc is None:
        raise RuntimeError("Redis is not running")
    cluster.pause()
    try:
        local.redis.proc.kill()
        await asyncio.sleep(down_s)
        local.redis.start()  # from this thread: Redis dies with the thread that started it
    finally:
        cluster.resume()
    restarted = time.monotonic()
    keys = Keys(local.specs[0].env.get("BATON_REDIS_PREFIX", "baton"))
    patterns = {
        "members": keys.member("*", "*"),
        "index": keys.block("*"),
        "watermarks": keys.watermark("*"),
    }
    back: dict[str, float] = {}
    r = redis.Redis.from_url(local.redis.url)
    try:
        while len(back) < len(patterns) and time.monotonic() - restarted < timeout_s:
            for name, pattern in patterns.items():
                if name in back:
                    continue
                found = len(r.keys(pattern))
                if found >= (members if name == "members" else 1):
                    back[name] = time.monotonic() - restarted
            await asyncio.sleep(0.1)
    finally:
        r.close()
    return back
