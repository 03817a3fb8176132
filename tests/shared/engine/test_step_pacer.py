"""Decode step pacing (pure policy; the loop's use of it is in test_engine_loop.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from shared.engine.step_pacer import BUSY_CORES, OthersCpu, StepPacer


def test_steps_are_spaced_to_the_margin_of_the_target_only_while_others_wait() -> None:
    busy = [True]
    pacer = StepPacer(0.1, contended=lambda: busy[0], margin=0.8)
    # a 30 ms step with streams and a busy neighbour: the next starts 80 ms after it began
    assert pacer.next_step_at(started=10.0, ended=10.03, streams=4) == pytest.approx(10.08)
    assert pacer.paced_steps == 1 and pacer.paced_s == pytest.approx(0.05)
    # a step that took the interval (TPOT nearing the target): the next one at once
    assert pacer.next_step_at(started=11.0, ended=11.09, streams=4) == 11.09
    # nobody waiting for the cores, or nothing streaming here: no pacing
    busy[0] = False
    assert pacer.next_step_at(started=12.0, ended=12.03, streams=4) == 12.03
    busy[0] = True
    assert pacer.next_step_at(started=13.0, ended=13.03, streams=0) == 13.03
    assert pacer.paced_steps == 1


def test_a_target_must_be_positive_and_the_margin_a_share() -> None:
    for tpot, margin in ((0.0, 0.8), (0.1, 0.0), (0.1, 1.5)):
        with pytest.raises(ValueError):
            StepPacer(tpot, contended=lambda: True, margin=margin)


def test_others_cpu_sees_a_busy_process_and_not_this_one() -> None:
    """A child spinning for a while counts as a busy core; this process's own spinning
    does not (it is the decode engine itself)."""
    if not OthersCpu.available():
        pytest.skip("no /proc here")
    cpu = OthersCpu(window_s=0.2)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # our own work
        pass
    assert cpu.busy_cores() < BUSY_CORES
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.1)
        cpu.busy_cores()  # a window starts with the child running
        time.sleep(0.4)
        assert cpu.busy_cores() >= 0.8 and cpu.contended()
    finally:
        child.kill()
        child.wait()
