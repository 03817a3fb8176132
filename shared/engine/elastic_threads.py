"""Elastic compute threads: an engine uses the cores the rest of the machine leaves idle.

On a shared machine (prefill and decode side by side, as ``baton up`` starts
them) each role is idle part of the time: at one request in flight the decode
instance waits while the prompt is computed, and the prefill instance waits
while the tokens are. A fixed thread count leaves that core unused. Before each
step the engine thread asks a :class:`ThreadGovernor` how many threads to run
the step on: the CPUs this process may use, less what other processes kept
busy over the last steps (``/proc/stat`` minus this process's own CPU time; after
an idle spell, the threads of other processes running at that moment), within
``[min_threads, max_threads]``. When the other role gets busy again, the
count shrinks back between two layers of the running step (its threads seen
running at a few layer boundaries in a row), or at the next step.

Changing the thread count never changes a result: every native kernel computes
an output element in one fixed order whatever the thread count (the
batch-invariance guarantee; tests/shared/engine/test_elastic_threads.py checks a
whole forward).

The policy (:func:`threads_for`) is pure; :class:`ProcStatSource` is the one part
that reads the machine, and a fake one can be passed in.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# /proc/stat counts in ticks (10 ms): a shorter window says little, keep the last decision
MIN_WINDOW_S = 0.05
# a longer window is stale (the engine was idle): count the threads running right now
MAX_WINDOW_S = 0.5
# instantaneous reads 1 ms apart; the fewest seen counts (a thread that ran at every read
# is busy, one that finished a moment's work, such as a stream's last token, is not)
RUNNING_READS = 5
PRESSED_CHECKS = 3
# a core counts as free when others used less than this share of it
FREE_MARGIN = 0.3


@dataclass(frozen=True)
class CpuSample:
    """Cumulative counters at one moment: seconds since boot the CPUs this process
    may use were busy (any process), and this process's own CPU seconds."""

    at: float
    busy_s: float
    own_s: float


class CpuSource(Protocol):
    def sample(self) -> CpuSample: ...

    def running_others(self) -> int:
        """Threads of other processes running or runnable at this moment."""
        ...

    @property
    def cpus(self) -> int: ...


def threads_for(cpus: int, others_busy: float, min_threads: int, max_threads: int) -> int:
    """Threads for the next step: the cores others left free, within the bounds."""
    free = math.floor(cpus - others_busy + FREE_MARGIN)
    return max(min_threads, min(max_threads, free))


def others_busy(before: CpuSample, after: CpuSample) -> float:
    """Cores other processes kept busy between two samples (never negative)."""
    wall = after.at - before.at
    if wall <= 0:
        return 0.0
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, others / wall)


class ThreadGovernor:
    """How many threads the next step gets. Called on the engine thread only."""

    def __init__(
        self,
        source: CpuSource,
        min_threads: int,
        max_threads: int,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not 1 <= min_threads <= max_threads:
            raise ValueError(f"need 1 <= min_threads {min_threads} <= max_threads {max_threads}")
        self.source = source
        self.min_threads = min_threads
        self.max_threads = max_threads
        self.current = min_threads
        self.changes = 0
        self._sleep = sleep
        self._last: CpuSample | None = None
        self._pressed = 0  # layer checks in a row that found our cores wanted

    def decide(self) -> int:
        now = self.source.sample()
        last = self._last
        if last is not None and now.at - last.at < MIN_WINDOW_S:
            return self.current
        if last is None or now.at - last.at > MAX_WINDOW_S:
            busy = float(self._running_now())  # idle since the last step
        else:
            busy = others_busy(last, now)
        threads = threads_for(self.source.cpus, busy, self.min_threads, self.max_threads)
        self._last = now
        if threads != self.current:
            self.changes += 1
            self.current = threads
        self._pressed = 0
        return threads

    def recheck(self) -> int:
        """Between the layers of a step: shrink as soon as other processes' threads were
        running at :data:`PRESSED_CHECKS` checks in a row on cores this step took (a
        step of a long prompt lasts seconds; the other role may have got busy since
        it began). Growing waits for the next step's decision."""
        if self.current <= self.min_threads:
            return self.current
        running = self.source.running_others()
        if running > 0 and self.current > self.source.cpus - running:
            self._pressed += 1
        else:
            self._pressed = 0
        if self._pressed >= PRESSED_CHECKS:
            self._pressed = 0
            self.current = threads_for(
                self.source.cpus, float(running), self.min_threads, self.max_threads
            )
            self.changes += 1
        return self.current

    def _running_now(self) -> int:
        reads = []
        for i in range(RUNNING_READS):
            if i:
                self._sleep(0.001)
            reads.append(self.source.running_others())
        return min(reads)


class ProcStatSource:
    """Busy time of this process's CPUs from ``/proc/stat`` (Linux), own time from the
    process clock."""

    def __init__(self, cpus: frozenset[int] | None = None, path: str = "/proc/stat"):
        """``cpus``: those the engine thread runs on (default: this thread's affinity)."""
        self.path = path
        self._allowed = sorted(cpus or os.sched_getaffinity(0))
        self._names = {f"cpu{c}" for c in self._allowed}
        self._tick = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def available() -> bool:
        return os.path.exists("/proc/stat") and hasattr(os, "sched_getaffinity")

    @property
    def cpus(self) -> int:
        return len(self._allowed)

    def sample(self) -> CpuSample:
        busy = 0
        with open(self.path, encoding="ascii") as f:
            for line in f:
                if not line.startswith("cpu"):
                    break
                name, *fields = line.split()
                if name in self._names:
                    # user nice system idle iowait irq softirq (steal: another guest's)
                    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
                    busy += user + nice + system + irq + softirq
        return CpuSample(time.monotonic(), busy / self._tick, time.process_time())

    def running_others(self) -> int:
        running = 0
        with open(self.path, encoding="ascii") as f:
            for line in f:
                if line.startswith("procs_running "):
                    running = int(line.split()[1])
                    break
        return max(0, running - _own_running_threads())


def _own_running_threads() -> int:
    """This process's threads that are running or runnable (the reading one included)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        if stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] == "R":
            n += 1
    return n
