"""The planner check's arguments: the splits it measures."""

from __future__ import annotations

from benchmarks.plan_check import parse_args


def test_defaults_measure_three_splits_of_two_cores() -> None:
    args = parse_args(["--trace", "t.csv"])
    assert args.splits == ["1:1", "1:2", "2:1"] and args.cores == 2
    assert parse_args(["--trace", "t.csv", "--splits", "1:3"]).splits == ["1:3"]
    assert parse_args(["--trace", "t.csv"]).repeats == 1
    assert parse_args(["--trace", "t.csv", "--repeats", "3"]).repeats == 3
