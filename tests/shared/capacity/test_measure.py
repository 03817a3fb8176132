"""``baton profile`` on the real engine, with few and small points; and ``baton plan``
from the command line on a saved profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.capacity.measure import measure
from shared.capacity.profile import load
from shared.cli import main
from tests.conftest import EngineFactory
from tests.shared.capacity.fake_profile import linear_profile


def test_measure_fills_a_profile_the_simulator_can_use(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    engine = make_engine()
    profile = measure(
        engine,
        threads=[1],
        prefill_tokens=(16, 64),
        decode_batches=(1, 4),
        decode_contexts=(32, 96),
        repeats=1,
        steps=2,
        transfer_mb=1,
    )
    assert [p.tokens for p in profile.prefill] == [16, 64]
    assert all(p.seconds > 0 for p in profile.prefill)
    assert {(d.batch, d.context // d.batch >= 32) for d in profile.decode} == {(1, True), (4, True)}
    assert profile.transfer_bytes_s > 1e6
    assert profile.kv_bytes_per_token == engine.layout.bytes_per_token
    assert profile.prefill_seconds(40, 1) > 0 and profile.decode_seconds(4, 400, 1) > 0
    assert not engine.has_unfinished() and engine.kv.num_free == engine.kv.num_slots
    profile.save(tmp_path / "p.json")
    assert load(tmp_path / "p.json").decode == profile.decode


def test_baton_plan_prints_a_ranking_and_a_recommendation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    linear_profile().save(tmp_path / "profile.json")
    trace = tmp_path / "azure.csv"
    rows = [f"2023-11-16 18:15:{10 + i:02d}.000000,{200 + 10 * i},{20 + i}" for i in range(20)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    argv = ["plan", "--workload", str(trace), "--slo-ttft", "2", "--slo-tpot", "0.1"]
    argv += ["--cores", "2", "--profile", str(tmp_path / "profile.json"), "--oversubscribe", "1.5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out and "| 3 |" in out
    assert main([*argv[:-2], "--cores", "0"]) == 2
