"""Elastic compute threads: an engine uses the cores the rest of the machine leaves idle.

On a shared machine (prefill and decode side by side, as ``baton up`` starts
them) each role is idle part of the time: at one request in flight the decode
instance waits while the prompt is computed, and the prefill instance waits
while the tokens are. A fixed thread count leaves that core unused. A
:class:`ThreadGovernor` sets each step's thread count on the engine thread,
within ``[min_threads, max_threads]``, from the threads of other processes it
sees running on this process's CPUs (``/proc/stat`` less this process's own):

- a step after an idle spell (a lone prompt arriving: the engine waited for work,
  or it has not looked for :data:`MAX_IDLE_S`) starts on every allowed core.
  What the last step saw is stale by then, and what ran as it arrived (the
  gateway routing it, decode taking its half, the client) or a moment before (a
  benchmark's other engine, a finished stream) is no reason to halve it;
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

import os
import time
from collections.abc import Callable
from typing import Protocol

# a governor that has not looked at the machine for this long was idle: the next step
# starts on every allowed core
MAX_IDLE_S = 0.5
PRESSED_CHECKS = 3
# between layers the running threads are read at most this often: a read walks this
# process's threads in /proc (~0.1-0.5 ms), too much for every layer of a short step
RECHECK_S = 0.02


class CpuSource(Protocol):
    def running_others(self) -> int:
        """Threads of other processes running or runnable at this moment."""
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

    def decide(self, after_idle: bool = False) -> int:
        """The thread count of the step about to start; ``after_idle``: the engine
        waited for work since its last step (what that step saw is stale)."""
        at = self._clock()
        if after_idle or at - self._looked > MAX_IDLE_S:  # idle since the last step: every core
            self._set(self.max_threads)
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

    def _set(self, threads: int) -> None:
        if threads != self.current:
            self.changes += 1
            self.current = threads


class ProcStatSource:
    """Threads running on the machine from ``/proc/stat`` (Linux), this process's own from
    ``/proc/self/task``."""

    def __init__(self, cpus: frozenset[int] | None = None, path: str = "/proc/stat"):
        """``cpus``: those the engine thread runs on (default: this thread's affinity)."""
        self.path = path
        self._allowed = sorted(cpus or os.sched_getaffinity(0))

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
        own = _own_running_threads()
        running = 0
        with open(self.path, encoding="ascii") as f:
            for line in f:
                if line.startswith("procs_running "):
                    running = int(line.split()[1])
                    break
        return max(0, running - max(own, _own_running_threads()))


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
