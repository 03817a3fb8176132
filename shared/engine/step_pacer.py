"""Decode steps paced to the TPOT target, so that the slack goes to prefill.

A decode instance streams as fast as its steps run. Under load its steps take a
fraction of any TPOT target a user sets (35-45 ms against 100-250), while the
prompts on the same cores wait for the one core decode leaves (every missed SLO
was a TTFT miss: issue 31's measurements). With a target set, a
:class:`StepPacer` starts the next step no sooner than ``margin x target`` after
the last one started, while streams run here and another process wants these
cores; the decode thread sleeps meanwhile, so the prefill instance's elastic
threads get the core, and the requests that arrive meanwhile join the next step
(larger batches). A step that itself takes the interval is followed at once: when
TPOT nears the target, decode takes its time back on the next step. With nobody
waiting for the cores, or no target, steps run back to back as before.

Pacing moves when a step runs, never what it computes: tokens are the same.
The policy is pure (the contention test is passed in); the engine loop applies it.
"""

from __future__ import annotations

from collections.abc import Callable

# steps start no closer than this share of the TPOT target: the rest is room for a
# step that runs slower (a prompt chunk lent in, a busy neighbour) and for the gateway
PACE_MARGIN = 0.8


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
