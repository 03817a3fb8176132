"""The mixed-pool benchmark's arguments: which fixed splits and mixed pools it runs."""

from __future__ import annotations

import pytest

from benchmarks.mixed_bench import parse_args, split


def test_defaults_compare_both_three_instance_splits_fixed_and_mixed() -> None:
    args = parse_args(["--trace", "t.csv"])
    assert args.fixed == ["2:1", "1:2"] and args.mixed == ["2:1", "1:2"]
    assert split("2:1") == (2, 1)
    with pytest.raises(ValueError):
        split("2")
