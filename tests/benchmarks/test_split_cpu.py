"""The split CPU benchmark's arithmetic: an engine's figures over a run, from its counters."""

from __future__ import annotations

import pytest

from benchmarks.split_cpu import Counters, parse_args


def test_a_run_is_the_difference_of_two_readings() -> None:
    before = Counters(steps=100, step_s=2.0, engine_cpu_s=1.5, other_cpu_s=0.5)
    after = Counters(steps=946, step_s=23.6, engine_cpu_s=15.3, other_cpu_s=2.0)
    run = after.since(before, "decode")
    assert (run.role, run.steps) == ("decode", 846)
    assert run.work_s == pytest.approx(13.8) and run.busy_s == pytest.approx(21.6)
    assert run.share == pytest.approx(13.8 / 21.6)


def test_defaults_measure_three_splits_of_two_cores_over_ucx() -> None:
    args = parse_args(["--trace", "t.csv"])
    assert args.splits == ["1:1", "1:2", "2:1"] and args.cores == 2
    assert args.transport == "ucx"
