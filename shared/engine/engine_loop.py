"""Runs an :class:`Engine` on its own thread, driven from an asyncio service.

Ownership: the engine (scheduler, KV cache manager, KV tensors, connector
calls) is touched only on the engine thread. The asyncio side reaches it
through :meth:`EngineLoop.call` (run a function on the engine thread between
two steps, await its result) and :meth:`EngineLoop.post` (the same, fire and
forget); each request's outputs arrive on the asyncio queue
:meth:`EngineLoop.subscribe` returned. After every step and command the loop
publishes the engine's :class:`EngineSnapshot` (read :attr:`snapshot` from any
thread) and hands the block keys its pool started or stopped holding to
``on_kv_events`` on the event loop. The thread sleeps while nothing is
runnable, so an idle service costs no CPU; :meth:`wake` rouses it (a transfer
that ended outside the engine). With a :class:`ThreadGovernor` the thread count
of each step follows the cores the rest of the machine leaves idle.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from shared.engine.cpu_load import IDLE_LOOK_S
from shared.engine.elastic_threads import ThreadGovernor
from shared.engine.engine import Engine
from shared.engine.kv_events import KVEvents
from shared.engine.outputs import RequestOutput
from shared.engine.snapshot import EngineSnapshot
from shared.engine.step_pacer import StepPacer
from shared.procs import name_thread

T = TypeVar("T")
log = logging.getLogger(__name__)

ENGINE_THREAD = "baton-engine"  # the engine thread's OS name

ENGINE_DIED = None
"""Put on every subscribed queue when the engine thread dies (so no request waits forever)."""


class Interrupted:
    """Put on a request's queue by :meth:`EngineLoop.interrupt`: stop reading it."""


INTERRUPTED = Interrupted()
Output = RequestOutput | Interrupted | None


class StreamInterrupted(Exception):
    """Its reader was told to stop reading a request (:meth:`EngineLoop.interrupt`)."""


async def next_output(outputs: asyncio.Queue[Output]) -> RequestOutput:
    """The next output of a subscribed request; raises if the engine died or the request
    was interrupted."""
    out = await outputs.get()
    if out is None:
        raise RuntimeError("the engine stopped")
    if isinstance(out, Interrupted):
        raise StreamInterrupted()
    return out


async def on_passing_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own that ends with it.

    OpenMP keeps a pool of worker threads for every thread that ever ran a parallel
    region, for as long as that thread lives, and once a process holds more of them
    than it has CPUs, libgomp stops letting idle workers spin: every parallel region
    then pays a wake-up (about 50 us here, against 20 us for a whole RMSNorm of 256
    rows). Work that runs OpenMP before the engine thread starts (loading and packing
    weights) runs here, so its pool goes with the thread."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:
            loop.call_soon_threadsafe(_settle, fut, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, fut, result, None)

    thread = threading.Thread(target=run, name="engine-start", daemon=True)
    thread.start()
    try:
        return await fut
    finally:
        await asyncio.to_thread(thread.join)


def _settle(fut: asyncio.Future[T], result: T | None, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)  # type: ignore[arg-type]


def keep_openmp_off_this_thread() -> None:
    """This thread (an event loop's) runs torch ops with one thread: the small copies
    it makes never start an OpenMP pool of their own (see :func:`on_passing_thread`).
    The count is per thread; the engine thread sets its own."""
    torch.set_num_threads(1)


# one step moves the recent step time this far (exponentially weighted mean)
STEP_EWMA_WEIGHT = 0.25
# an engine that has not stepped for this long has no recent step time
IDLE_AFTER_S = 1.0


@dataclass
class LoopStats:
    """Written by the engine thread; readers elsewhere see a step's figures or the last's."""

    steps: int = 0
    busy_s: float = 0.0
    last_step_s: float = 0.0
    threads: int = 0  # of the last step
    thread_changes: int = 0
    recent_step_s: float = 0.0  # mean of the recent steps' durations, weighted to the last
    recent_tokens_s: float = 0.0  # tokens computed per second of step, weighted the same
    last_step_end: float = 0.0  # time.perf_counter()
    # step seconds by the thread count they ran on (a step may shrink between layers)
    thread_seconds: dict[int, float] = field(default_factory=dict)
    _counting_since: float | None = None  # inside a step: when the current count began
    step_since: float | None = None  # inside a step: when it began (perf_counter)

    def step_started(self, threads: int, now: float) -> None:
        self.threads, self._counting_since, self.step_since = threads, now, now

    def threads_changed(self, threads: int, now: float) -> None:
        """Between two layers of a step (or before one): the count from now on."""
        self._count(now)
        self.threads = threads

    def step_ended(self, now: float) -> None:
        self._count(now)
        self._counting_since = self.step_since = None

    def _count(self, now: float) -> None:
        if self._counting_since is not None:
            spent = now - self._counting_since
            self.thread_seconds[self.threads] = self.thread_seconds.get(self.threads, 0.0) + spent
            self._counting_since = now

    def observe_step(self, seconds: float, end: float, tokens: int = 0) -> None:
        self.steps += 1
        self.busy_s += seconds
        self.last_step_s = seconds
        w = STEP_EWMA_WEIGHT if self.recent_step_s else 1.0
        self.recent_step_s += w * (seconds - self.recent_step_s)
        if tokens and seconds > 0:  # kept while idle: how fast this engine computes prompts
            w = STEP_EWMA_WEIGHT if self.recent_tokens_s else 1.0
            self.recent_tokens_s += w * (tokens / seconds - self.recent_tokens_s)
        self.last_step_end = end

    def step_time(self, now: float) -> float:
        """How long this engine's steps take lately (what a stream here waits per
        token); 0 once it has not stepped for :data:`IDLE_AFTER_S`."""
        if not self.steps or now - self.last_step_end > IDLE_AFTER_S:
            return 0.0
        return self.recent_step_s


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        *,
        on_step: Callable[[float, int], None] | None = None,
        on_kv_events: Callable[[KVEvents], None] | None = None,
        cpus: frozenset[int] | None = None,
        threads: ThreadGovernor | None = None,
        pacer: StepPacer | None = None,
    ):
        self.engine = engine
        self.pacer = pacer  # decode with a TPOT target: steps spaced while others wait
        self.cpus = cpus  # pin the engine thread (and the torch threads it starts) to these
        self.on_step = on_step  # (seconds, tokens computed), on the engine thread
        self.on_kv_events = on_kv_events  # on the event loop
        self.threads = threads
        if threads is not None:
            engine.between_layers = self._recheck_threads
        self.stats = LoopStats()
        self.snapshot: EngineSnapshot = engine.snapshot()
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue[Output]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self._not_before = 0.0  # perf_counter: a paced engine's next step
        self._waited = False  # the thread waited for work since its last computing step

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join, 30.0)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    # -- talking to the engine thread ------------------------------------------------
    def post(self, fn: Callable[[Engine], Any]) -> None:
        """Run ``fn(engine)`` on the engine thread soon; errors are logged."""

        def run() -> None:
            try:
                fn(self.engine)
            except Exception:
                log.exception("engine command failed")

        self._commands.put(run)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        loop = self._require_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:
                loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, result, None)

        if not self.alive:
            raise RuntimeError("the engine loop is not running")
        self._commands.put(run)
        return await fut

    def wake(self) -> None:
        """Rouse an idle engine thread (thread-safe): something it polls has changed."""
        self._commands.put(_nothing)

    def subscribe(self, request_id: str) -> asyncio.Queue[Output]:
        """Outputs of ``request_id`` in order; ``None`` means the engine died,
        :data:`INTERRUPTED` that :meth:`interrupt` was called."""
        q: asyncio.Queue[Output] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def interrupt(self, request_id: str) -> None:
        """Tell the reader of ``request_id``'s outputs to stop, after those queued."""
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(INTERRUPTED)

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("EngineLoop.start() was not called")
        return self._loop

    # -- the engine thread -----------------------------------------------------------
    def _run(self) -> None:
        stalled = False  # the last step found nothing runnable: wait for a command
        name_thread(ENGINE_THREAD)  # the profile tells its CPU from the process's other threads
        try:
            if self.cpus:  # Linux affinity is per thread: the event loop keeps its own CPUs
                os.sched_setaffinity(0, self.cpus)
            # OpenMP's thread count is per thread: this one's is the engine's
            if self.engine.config.num_threads:
                self.engine.set_num_threads(self.engine.config.num_threads)
            while True:
                runnable = self.engine.has_unfinished() and not stalled
                try:
                    if not runnable:
                        self._waited = True
                        cmd = self._wait_for_command()
                    else:  # a paced step waits for its time, taking commands meanwhile
                        wait = self._not_before - time.perf_counter()
                        cmd = (
                            self._commands.get(timeout=wait)
                            if wait > 0
                            else self._commands.get_nowait()
                        )
                except queue.Empty:
                    stalled = not self._step_once()
                    continue
                if cmd is None:
                    return
                cmd()  # commands drain one per turn, ahead of the next step
                self._publish()
                stalled = False
                if self.snapshot.prompt_pending:  # a prompt never waits out a paced gap
                    self._not_before = 0.0
        except BaseException as exc:
            self.failure = exc
            log.exception("engine loop died")
            self._require_loop().call_soon_threadsafe(self._fail_all)

    def _wait_for_command(self) -> Callable[[], None] | None:
        """The next command; meanwhile the governor looks at the machine now and then."""
        if self.threads is None:
            return self._commands.get()
        while True:
            try:
                return self._commands.get(timeout=IDLE_LOOK_S)
            except queue.Empty:
                self.threads.observe()

    def _publish(self) -> None:
        self.snapshot = self.engine.snapshot()
        events = self.engine.take_kv_events()
        if events and self.on_kv_events is not None:
            self._require_loop().call_soon_threadsafe(self.on_kv_events, events)

    def _fail_all(self) -> None:
        for q in self._queues.values():
            q.put_nowait(ENGINE_DIED)

    def _step_once(self) -> bool:
        """One engine step; False when nothing was runnable."""
        if self.threads is not None:
            self._use_threads(self.threads.decide(after_idle=self._waited))
        t0 = time.perf_counter()
        self.stats.step_started(self.stats.threads or torch.get_num_threads(), t0)
        outputs = self.engine.step(defer_copies=True)
        end = time.perf_counter()
        dt = end - t0
        self.stats.step_ended(end)
        if self.engine.last_step_tokens:
            self._waited = False
            self.stats.observe_step(dt, end, self.engine.last_step_tokens)
            if self.on_step is not None:
                self.on_step(dt, self.engine.last_step_tokens)
        self._publish()
        if outputs:
            self._require_loop().call_soon_threadsafe(self._deliver, outputs)
        self.engine.flush_copies()  # what waited for the outputs to leave
        # never paced while a prompt is computed here (a recompute, a lent prompt)
        if (
            self.pacer is not None
            and self.engine.last_step_tokens
            and not self.snapshot.prompt_pending
        ):
            self._not_before = self.pacer.next_step_at(t0, end, self.snapshot.running)
        return self.engine.last_step_tokens != 0

    def _use_threads(self, n: int) -> None:
        if n != self.stats.threads:
            self.engine.set_num_threads(n)
            self.stats.threads_changed(n, time.perf_counter())
        if self.threads is not None:
            self.stats.thread_changes = self.threads.changes

    def _recheck_threads(self) -> None:
        if self.threads is not None:
            self._use_threads(self.threads.recheck())

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)


def _nothing() -> None:
    """The command :meth:`EngineLoop.wake` posts."""
