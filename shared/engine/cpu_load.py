"""How many cores other processes keep busy right now: the part of the machine an
engine's threads cannot count on.

A snapshot of the run queue (what :class:`~shared.engine.elastic_threads.ThreadGovernor`
reads between layers) tells who runs at one instant; a load generator on the same
machine (aiperf's timing loop keeps ~0.9 of a core busy) is caught at one look and
missed at the next. What it costs is not subtle: a 512-token prefill on 2 threads
beside one busy process took 484 ms where 1 thread took 175 ms (Intel Xeon, 2 vCPUs),
because every parallel region ends in a barrier that waits for the thread the other
process holds off its core. So the governor also asks how much CPU the rest of the
machine used over each of the last :data:`LOAD_WINDOWS` windows of
:data:`LOAD_WINDOW_S`: busy time on the engine's cores (``/proc/stat``) less this
process's and its siblings' engine threads'. A load generator is in every one; a
burst that ended a window before the prompt came (a benchmark's other engine, a
finished stream) says nothing about the prompt and is not in the newest, and one as
short as a request's routing is too small a share of any to count. An idle engine
reads the machine every :data:`IDLE_LOOK_S`, so windows ending at a prompt's arrival
are there to read.

:class:`RecentLoad` is pure (fed :class:`CpuTimes` readings); reading the machine
is :func:`busy_seconds` and the source in ``elastic_threads``.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

# the load is read over each of this many windows of at least this long, back from
# now (/proc/stat counts in 10 ms ticks)
LOAD_WINDOW_S = 0.05
LOAD_WINDOWS = 3
# how often an engine waiting for work reads the machine (a look: ~60 us)
IDLE_LOOK_S = 0.05
# other processes are taken to hold a core from this share of one over the window: a
# process spinning reads ~1.0, a client with the gateway streaming 0.1-0.3, and the
# last tens of ms of a burst that ended as the window began (with OpenMP's workers
# spinning after it) up to ~0.5
CORE_SHARE = 0.7
# /proc/stat's per-CPU columns that count as busy: user nice system (idle iowait) irq softirq
_BUSY_COLUMNS = (0, 1, 2, 5, 6)


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative CPU-seconds at one moment."""

    at: float  # monotonic seconds of the reading
    machine: float  # the engine's cores busy, whoever ran on them
    ours: float  # this process's threads, and the siblings' engine threads


class RecentLoad:
    """Cores' worth of CPU the other processes used over each of the last ``windows``
    windows of ~``window_s``, the smallest: a steady load is in every one, a burst that
    ended a window ago (a benchmark's other engine, with OpenMP's workers spinning
    after it) in the older ones only."""

    def __init__(self, window_s: float = LOAD_WINDOW_S, windows: int = LOAD_WINDOWS):
        self.window_s = window_s
        self.windows = windows
        self._readings: deque[CpuTimes] = deque()

    def due(self, now: float) -> bool:
        """Whether a reading at ``now`` adds anything (readings a fraction of the
        window apart suffice; closer ones are not worth taking)."""
        return not self._readings or now - self._readings[-1].at >= self.window_s / 8

    def add(self, reading: CpuTimes) -> None:
        self._readings.append(reading)
        # keep the readings the oldest window may start at (and a window more)
        span = (self.windows + 1) * self.window_s
        while len(self._readings) > 2 and reading.at - self._readings[1].at >= span:
            self._readings.popleft()

    def cores(self) -> float:
        """The other processes' cores over each of the windows ending at the newest
        reading (each from the newest reading at least a window before its end), the
        smallest; 0 while there are not that many (the machine is taken to be free)."""
        if not self._readings:
            return 0.0
        end, loads = self._readings[-1], []
        for _ in range(self.windows):
            start = next(
                (r for r in reversed(self._readings) if end.at - r.at >= self.window_s), None
            )
            if start is None:
                return 0.0
            loads.append(_others(start, end))
            end = start
        return min(loads)

    def held_cores(self) -> int:
        """Whole cores the other processes are taken to hold."""
        return math.floor(self.cores() + (1.0 - CORE_SHARE))


def _others(start: CpuTimes, end: CpuTimes) -> float:
    """Cores' worth of CPU the other processes used from ``start`` to ``end``."""
    others = (end.machine - start.machine) - (end.ours - start.ours)
    return max(0.0, others / (end.at - start.at))


def busy_seconds(stat_lines: Iterable[str], cpus: Iterable[int]) -> float:
    """Busy CPU-seconds of ``cpus`` from ``/proc/stat``'s lines (its ``cpuN`` rows)."""
    wanted = {f"cpu{c}" for c in cpus}
    ticks = 0
    for line in stat_lines:
        if not line.startswith("cpu"):
            break  # the cpu rows come first
        fields = line.split()
        if fields[0] in wanted:
            ticks += sum(int(fields[1 + i]) for i in _BUSY_COLUMNS)
    return ticks / _ticks_per_second()


def thread_seconds(stat: str) -> float:
    """utime + stime of a ``/proc/<pid>/task/<tid>/stat`` text, in seconds."""
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _ticks_per_second()


def _ticks_per_second() -> int:
    return os.sysconf("SC_CLK_TCK")
