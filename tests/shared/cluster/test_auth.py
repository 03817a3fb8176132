"""The cluster secret file compose's one-shot service leaves for the others (pure file
logic): the user's secret wins, an earlier one is kept, else one is made."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from shared.cluster.auth import MIN_SECRET_CHARS, write_secret_file
from shared.errors import ConfigError


def test_a_secret_is_made_once_and_kept_across_ups(tmp_path: Path) -> None:
    path = tmp_path / "secret" / "cluster-secret"
    assert write_secret_file(path, None)
    first = path.read_text()
    assert len(first.strip()) >= MIN_SECRET_CHARS
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # its owner's only
    assert not write_secret_file(path, None)  # the next `up`: the cluster keeps its secret
    assert path.read_text() == first
    assert not list(path.parent.glob("*.partial"))


def test_the_users_secret_wins_over_the_files(tmp_path: Path) -> None:
    path = tmp_path / "cluster-secret"
    write_secret_file(path, None)
    given = "a" * 40
    assert write_secret_file(path, f"  {given}\n")
    assert path.read_text().strip() == given
    assert not write_secret_file(path, given)


def test_a_short_secret_is_refused_and_a_short_file_replaced(tmp_path: Path) -> None:
    path = tmp_path / "cluster-secret"
    with pytest.raises(ConfigError, match="fewer than"):
        write_secret_file(path, "short")
    assert not path.exists()
    path.write_text("short\n")
    assert write_secret_file(path, None)
    assert len(path.read_text().strip()) >= MIN_SECRET_CHARS
