"""Decode steps paced to the TPOT target, so that the slack goes to prefill.

A decode instance streams as fast as its steps run. Under load its steps take a
fraction of any TPOT target a user sets (35-45 ms against 100-250), while the
prompts on the same cores wait for the one core decode leaves (every missed SLO
was a TTFT miss: issue 31's measurements). With a target set, a
:class:`StepPacer` starts the next step no sooner than ``margin x target`` after
the last one started, while streams run here and other processes kept at least
:data:`BUSY_CORES` busy lately (:class:`OthersCpu`: a prompt being computed); the
decode thread sleeps meanwhile, so the prefill instance's elastic
threads get the core, and the requests that arrive meanwhile join the next step
(larger batches). A step that itself takes the interval is followed at once: when
TPOT nears the target, decode takes its time back on the next step. With nobody
waiting for the cores, or no target, steps run back to back as before.

Pacing moves when a step runs, never what it computes: tokens are the same.
The policy is pure (the contention test is passed in); the engine loop applies it.
Why pacing rather than fewer threads or OS weights: decode already runs one thread,
and a lower scheduling weight would let a long prompt starve the streams; a paced
step is bounded by the target by construction.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

# steps start no closer than this share of the TPOT target: the rest is room for a
# step that runs slower (a prompt chunk lent in, a busy neighbour) and for the gateway
PACE_MARGIN = 0.8
# other processes count as wanting the cores when they kept this many busy lately: a
# prompt being computed keeps one or more; the gateway and clients relaying this
# instance's own tokens keep a fraction of one (a check of who is running as a step
# ends sees exactly those: it paced at every load, for nobody)
BUSY_CORES = 0.6
# CPU time is read at most this often (clock ticks are 10 ms: shorter windows are noise)
CPU_WINDOW_S = 0.1


class StepPacer:
    """When the next decode step may start. Used on the engine thread only."""

    def __init__(self, tpot_s: float, contended: Callable[[], bool], margin: float = PACE_MARGIN):
        if tpot_s <= 0 or not 0 < margin <= 1:
            raise ValueError(f"need tpot_s > 0 and 0 < margin <= 1, got {tpot_s}, {margin}")
        self.interval_s = margin * tpot_s
        self.contended = contended
        self.paced_steps = 0
        self.paced_s = 0.0  # time given away

    def next_step_at(self, started: float, ended: float, streams: int) -> float:
        """The earliest start of the step after one that ran ``started`` .. ``ended``
        with ``streams`` requests decoding (same clock)."""
        due = started + self.interval_s
        if streams == 0 or ended >= due or not self.contended():
            return ended
        self.paced_steps += 1
        self.paced_s += due - ended
        return due


class OthersCpu:
    """Cores that processes other than this one kept busy over the last window, from
    ``/proc/stat``'s aggregate busy time less this process's own (``/proc/self/stat``).
    Linux only (:meth:`available`); used on the engine thread."""

    def __init__(self, window_s: float = CPU_WINDOW_S):
        self.window_s = window_s
        self._tick = os.sysconf("SC_CLK_TCK")
        self._last = self._read()
        self.cores = 0.0

    @staticmethod
    def available() -> bool:
        return os.path.exists("/proc/stat") and os.path.exists("/proc/self/stat")

    def _read(self) -> tuple[float, float, float]:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # not idle/iowait
        with open("/proc/self/stat", encoding="ascii") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        own = int(after_name[11]) + int(after_name[12])  # utime, stime
        return time.monotonic(), busy / self._tick, own / self._tick

    def busy_cores(self) -> float:
        """Others' busy cores over the last window (the previous figure until a window
        has passed)."""
        now = self._read()
        wall = now[0] - self._last[0]
        if wall >= self.window_s:
            self.cores = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
            self._last = now
        return self.cores

    def contended(self) -> bool:
        return self.busy_cores() >= BUSY_CORES
