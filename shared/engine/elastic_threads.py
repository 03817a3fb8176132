"""Elastic compute threads: an engine uses the cores the rest of the machine leaves idle.

On a shared machine (prefill and decode side by side, as ``baton up`` starts
them) each role is idle part of the time: at one request in flight the decode
instance waits while the prompt is computed, and the prefill instance waits
while the tokens are. A fixed thread count leaves that core unused. A
:class:`ThreadGovernor` sets each step's thread count on the engine thread,
within ``[min_threads, max_threads]``, from the threads of other processes it
sees running on this process's CPUs (``/proc/stat`` less this process's own):

- a step after an idle spell (a lone prompt arriving: the engine waited for work,
  or it has not looked for :data:`MAX_IDLE_S`) starts on every allowed core but
  those the other roles' engines compute on at that moment (the engine threads
  of the processes started beside this one: decode streaming). What the last
  step saw is stale by then, and whatever else ran as it arrived (the gateway
  routing it, decode taking its half, the client) or a moment before (a
  benchmark's other engine, a finished stream) is no reason to halve it. The one
  exception is a process that kept a core busy over each of the last three 50 ms
  windows (a load generator on the same machine: :mod:`shared.engine.cpu_load`),
  whose core the step starts without: two threads on one free core stall at every
  barrier, far slower than one. (The machine is read for it while the engine waits
  for work: with the step's own threads busy, ``/proc/stat``'s tick-sampled counts
  err by more than a light load);
- between layers, at most every :data:`RECHECK_S`, it looks again: the count
  shrinks once other threads were seen on the cores this step took at
  :data:`PRESSED_CHECKS` looks in a row (the other role got busy) and grows back
  once as many looks found cores free; the next step starts where the last ended.

Changing the thread count never changes a result: every native kernel computes
an output element in one fixed order whatever the thread count (the
batch-invariance guarantee; tests/shared/engine/test_elastic_threads.py checks a
whole forward).

The policy (:func:`threads_for`) is pure; :class:`ProcStatSource` is the one part
that reads the machine, and a fake one can be passed in.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from typing import Protocol

from shared.engine.cpu_load import CpuTimes, RecentLoad, busy_seconds, thread_seconds

# a governor that has not looked at the machine for this long was idle: the next step
# starts on every allowed core
MAX_IDLE_S = 0.5
PRESSED_CHECKS = 3
# between layers the running threads are read at most this often: a read walks this
# process's threads in /proc (~0.1-0.5 ms), too much for every layer of a short step
RECHECK_S = 0.02
# the sibling processes' engine threads are looked up again at most this often (a
# restarted role is found as soon); between lookups only their states are read
SIBLINGS_REFRESH_S = 5.0


class CpuSource(Protocol):
    def running_others(self) -> int:
        """Threads of other processes running or runnable at this moment."""
        ...

    def busy_siblings(self) -> int:
        """Engine threads of the other roles started beside this process running or
        runnable at this moment."""
        ...

    def cpu_times(self) -> CpuTimes:
        """Cumulative CPU time of this process's cores, and of this process and the
        siblings' engine threads (:mod:`shared.engine.cpu_load`)."""
        ...

    @property
    def cpus(self) -> int: ...


def threads_for(cpus: int, running_others: int, min_threads: int, max_threads: int) -> int:
    """Threads for the rest of a step: the cores others leave free, within the bounds."""
    return max(min_threads, min(max_threads, cpus - running_others))


class ThreadGovernor:
    """How many threads the next step gets. Called on the engine thread only."""

    def __init__(
        self,
        source: CpuSource,
        min_threads: int,
        max_threads: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 1 <= min_threads <= max_threads:
            raise ValueError(f"need 1 <= min_threads {min_threads} <= max_threads {max_threads}")
        self.source = source
        self.min_threads = min_threads
        self.max_threads = max_threads
        self.current = min_threads
        self.changes = 0
        self._clock = clock
        self._looked = -1e9  # when a step began or a recheck read the machine, last
        self._pressed = 0  # checks in a row that found our cores wanted
        self._relaxed = 0  # checks in a row that found more cores free than we use
        self.load = RecentLoad()  # what other processes kept busy lately
        # cores the other processes held at the last look (read from any thread)
        self.held = 0

    def decide(self, after_idle: bool = False) -> int:
        """The thread count of the step about to start; ``after_idle``: the engine
        waited for work since its last step (what that step saw is stale)."""
        at = self._clock()
        if after_idle or at - self._looked > MAX_IDLE_S:  # idle since the last step
            busy = self.source.busy_siblings() + self._held(at)
            self._set(threads_for(self.source.cpus, busy, self.min_threads, self.max_threads))
            self._pressed = self._relaxed = 0
        self._looked = at
        return self.current

    def recheck(self) -> int:
        """Between the layers of a step (a long prompt's lasts seconds, and the other role
        may get busy or idle meanwhile): shrink once other processes' threads were seen
        running on cores this step took at :data:`PRESSED_CHECKS` checks in a row, grow
        once more cores were seen free as many times. Reads at most every
        :data:`RECHECK_S`."""
        at = self._clock()
        if at - self._looked < RECHECK_S:
            return self.current
        self._looked = at
        running = self.source.running_others()
        free = threads_for(self.source.cpus, running, self.min_threads, self.max_threads)
        self._pressed = self._pressed + 1 if free < self.current else 0
        self._relaxed = self._relaxed + 1 if free > self.current else 0
        if self._pressed >= PRESSED_CHECKS or self._relaxed >= PRESSED_CHECKS:
            self._set(free)
            self._pressed = self._relaxed = 0
        return self.current

    def observe(self) -> None:
        """A look at the machine while the engine waits for work (every
        :data:`~shared.engine.cpu_load.IDLE_LOOK_S`), so that the window the next
        step's count is decided on ends at its start."""
        self._held(self._clock())

    def _held(self, at: float) -> int:
        """Cores other processes kept busy lately (the machine is read when due)."""
        if self.load.due(at):
            self.load.add(self.source.cpu_times())
            self.held = self.load.held_cores()
        return self.held

    def _set(self, threads: int) -> None:
        if threads != self.current:
            self.changes += 1
            self.current = threads


class ProcStatSource:
    """Threads running on the machine from ``/proc/stat`` (Linux), this process's own from
    ``/proc/self/task``, its siblings' engine threads from their ``/proc`` entries."""

    def __init__(
        self,
        cpus: frozenset[int] | None = None,
        path: str = "/proc/stat",
        engine_thread: str | None = None,
        parent: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``cpus``: those the engine thread runs on (default: this thread's affinity);
        ``engine_thread``: the OS name of the engine threads (and the compute threads
        they start) in the processes ``parent`` (default: this one's) started beside
        this one."""
        self.path = path
        self._allowed = sorted(cpus or os.sched_getaffinity(0))
        self._engine_thread = engine_thread
        self._parent = parent
        self._clock = clock
        self._siblings: list[str] = []  # /proc stat paths of the siblings' engine threads
        self._found_at = -math.inf
        self._own = _OwnThreads()
        self._siblings_seen: dict[str, float] = {}  # each engine thread's CPU seconds, last read
        self._siblings_total = 0.0

    @staticmethod
    def available() -> bool:
        return os.path.exists("/proc/stat") and hasattr(os, "sched_getaffinity")

    @property
    def cpus(self) -> int:
        return len(self._allowed)

    def running_others(self) -> int:
        # this process's threads flip between running and waiting at every parallel
        # region: counted before and after the system-wide count, the larger stands (a
        # worker that went to sleep in between must not pass for another process)
        own = self._own.running()
        running = 0
        with open(self.path, encoding="ascii") as f:
            for line in f:
                if line.startswith("procs_running "):
                    running = int(line.split()[1])
                    break
        return max(0, running - max(own, self._own.running()))

    def busy_siblings(self) -> int:
        return sum(_running(path) for path in self._sibling_paths())

    def cpu_times(self) -> CpuTimes:
        at = self._clock()
        with open(self.path, encoding="ascii") as f:
            machine = busy_seconds(f, self._allowed)
        return CpuTimes(at, machine, time.process_time() + self._siblings_seconds())

    def _siblings_seconds(self) -> float:
        """The siblings' engine threads' CPU time since this source first saw each (a
        thread that ends, or one found later, never moves the sum backwards)."""
        seen = {}
        for path in self._sibling_paths():
            stat = _read_stat(path)
            if stat is not None:
                now = seen[path] = thread_seconds(stat)
                self._siblings_total += max(0.0, now - self._siblings_seen.get(path, now))
        self._siblings_seen = seen
        return self._siblings_total

    def _sibling_paths(self) -> list[str]:
        if self._engine_thread is None:
            return []
        now = self._clock()
        if now - self._found_at > SIBLINGS_REFRESH_S:
            self._siblings = sibling_threads(self._engine_thread, self._parent)
            self._found_at = now
        return self._siblings


def sibling_threads(name: str, parent: int | None = None) -> list[str]:
    """The ``/proc`` stat paths of the threads called ``name`` in the other children of
    ``parent`` (default: this process's parent)."""
    parent = os.getppid() if parent is None else parent
    pids: set[str] = set()
    with contextlib.suppress(OSError):  # the parent ended, or no children files here
        for task in os.listdir(f"/proc/{parent}/task"):
            with open(f"/proc/{parent}/task/{task}/children", encoding="ascii") as f:
                pids.update(f.read().split())
    pids.discard(str(os.getpid()))
    found = []
    for pid in sorted(pids):
        with contextlib.suppress(OSError):  # the process ended meanwhile
            for tid in os.listdir(f"/proc/{pid}/task"):
                comm = f"/proc/{pid}/task/{tid}/comm"
                with contextlib.suppress(OSError), open(comm, encoding="utf-8") as f:
                    if f.read().rstrip("\n") == name:
                        found.append(f"/proc/{pid}/task/{tid}/stat")
    return found


def _running(stat_path: str) -> bool:
    """Whether the thread is running or runnable (False once it ended)."""
    stat = _read_stat(stat_path)
    return stat is not None and stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] == "R"


def _read_stat(stat_path: str) -> str | None:
    try:
        with open(stat_path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


class _OwnThreads:
    """This process's threads that are running or runnable (the reading one included),
    read between layers: each thread's ``/proc`` stat file is opened once and read again
    in place (opening them all at every look took ~0.5 ms of the engine thread, with the
    compute threads idle meanwhile); the task list is read at every look, so a thread
    started since (OpenMP's, as the count grows) is never taken for another process's."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def running(self) -> int:
        tids = set(os.listdir("/proc/self/task"))
        for tid in self._fds.keys() - tids:
            self._drop(tid)
        count = 0
        for tid in tids:
            fd = self._fds.get(tid)
            try:
                if fd is None:
                    fd = self._fds[tid] = os.open(f"/proc/self/task/{tid}/stat", os.O_RDONLY)
                stat = os.pread(fd, 512, 0)
            except OSError:  # the thread ended meanwhile
                self._drop(tid)
                continue
            end = stat.rfind(b")")
            count += stat[end + 2 : end + 3] == b"R"
        return count

    def _drop(self, tid: str) -> None:
        fd = self._fds.pop(tid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
