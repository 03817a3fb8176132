"""A profile answers from its points: interpolation, the decode fit, files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from shared.capacity.profile import (
    DecodePoint,
    PrefillPoint,
    Profile,
    ProfileError,
    ServiceOverhead,
    SideCpu,
    load,
)
from tests.shared.capacity.fake_profile import linear_profile


def test_prefill_interpolates_and_extrapolates_along_the_measured_line() -> None:
    p = linear_profile(prefill_s_per_token=0.001)
    assert p.prefill_seconds(512, 1) == pytest.approx(0.512)
    assert p.prefill_seconds(1000, 1) == pytest.approx(1.0)  # between points
    assert p.prefill_seconds(4096, 1) == pytest.approx(4.096)  # past the last
    assert p.prefill_seconds(32, 1) == pytest.approx(0.032)  # before the first
    assert p.prefill_seconds(512, 2) == pytest.approx(0.256)
    assert p.prefill_seconds(512, 8) == pytest.approx(0.256)  # nearest measured below
    assert p.prefill_seconds(0, 1) == 0.0


def test_decode_fit_recovers_the_step_time_model() -> None:
    p = linear_profile(decode_base_s=0.01, decode_per_seq_s=0.001)
    assert p.decode_seconds(16, 16 * 500, 1) == pytest.approx(0.026, abs=1e-9)
    assert p.decode_seconds(16, 16 * 500, 2) == pytest.approx(0.013, abs=1e-9)
    assert p.threads == [1, 2]


def test_saved_profiles_load_back_and_bad_files_are_refused(tmp_path: Path) -> None:
    side = SideCpu(request_s=0.004, prompt_token_s=2e-6, output_token_s=1e-4)
    p = replace(
        linear_profile(),
        overhead=ServiceOverhead(
            0.05, 0.002, 0.0005, cluster=side, client=side, workers=replace(side, request_s=0.01)
        ),
    )
    p.save(tmp_path / "p.json")
    back = load(tmp_path / "p.json")
    assert back.prefill == p.prefill and back.decode == p.decode
    assert back.overhead == p.overhead
    # a profile saved before the side processes were measured charges nothing for them
    body = json.loads((tmp_path / "p.json").read_text())
    del body["overhead"]["cluster"], body["overhead"]["client"], body["overhead"]["workers"]
    (tmp_path / "older.json").write_text(json.dumps(body))
    older = load(tmp_path / "older.json").overhead
    assert older.request_s == 0.05 and older.cluster == SideCpu() == older.client == older.workers
    assert back.prefill_seconds(700, 1) == p.prefill_seconds(700, 1)
    (tmp_path / "old.json").write_text('{"version": 0}')
    with pytest.raises(ProfileError, match="version-1"):
        load(tmp_path / "old.json")
    (tmp_path / "bad.json").write_text('{"version": 1, "model": "m"}')
    with pytest.raises(ProfileError, match="malformed"):
        load(tmp_path / "bad.json")
    with pytest.raises(ProfileError, match="cannot read"):
        load(tmp_path / "missing.json")


def test_loads_move_the_sliding_layers_of_the_window_only(tmp_path: Path) -> None:
    """1,000 bytes a token, 800 of them sliding layers with a 512-token window: a load
    of a long prefix moves every layer of the window's tokens (and a block more) and the
    full-attention layers of the rest; without a window, everything."""
    p = replace(linear_profile(), kv_window=512, kv_window_bytes_per_token=800)
    assert p.load_bytes(300) == 300 * 1000
    assert p.load_bytes(4000) == 4000 * 200 + 528 * 800
    assert linear_profile().load_bytes(4000) == 4000 * 1000
    p.save(tmp_path / "p.json")
    assert load(tmp_path / "p.json").load_bytes(4000) == p.load_bytes(4000)


def test_a_profile_needs_both_phases() -> None:
    with pytest.raises(ProfileError):
        Profile("m", "bf16", "c", 16, 100, 1e9, (PrefillPoint(1, 64, 0.1),), ())
    with pytest.raises(ProfileError):
        Profile("m", "bf16", "c", 16, 100, 0, (), (DecodePoint(1, 1, 10, 0.1),))
