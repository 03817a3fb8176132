"""The planner: candidates that fit the cores, workloads in both trace formats, ranking."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.bench.workload import TraceFormatError
from shared.capacity.plan import candidates, evaluate, load_workload, table, up_command
from shared.capacity.sim_types import SimRequest
from tests.shared.capacity.fake_profile import linear_profile


def test_candidates_fit_the_cores_unless_oversubscribed() -> None:
    two = candidates(2, [1, 2], [64])
    assert [(d.prefill, d.decode, d.threads) for d in two] == [(1, 1, 1)]
    shared = candidates(2, [1], [16, 64], oversubscribe=1.5)
    splits = {(d.prefill, d.decode) for d in shared}
    assert splits == {(1, 1), (1, 2), (2, 1)}
    assert {d.max_seqs for d in shared} == {16, 64}
    assert {d.pace_s for d in shared} == {0.0}


def test_with_a_tpot_target_candidates_pace_decode_and_the_plan_says_how_to_run_it() -> None:
    """The planner simulates what ``baton up --slo-*`` runs (decode paced to 80% of the
    TPOT target) and prints that command, fixed threads as simulated."""
    (dep,) = candidates(2, [1], [16], slo_tpot=0.1)
    assert dep.pace_s == pytest.approx(0.08)
    assert up_command(dep, 3.0, 0.1) == (
        "BATON_MAX_NUM_SEQS=16 baton up --prefill 1 --decode 1 --threads 1 --max-threads 1"
        " --slo-ttft 3 --slo-tpot 0.1"
    )
    assert up_command(dep, 3.0, 0.1, "gemma3-270m").endswith(" --model gemma3-270m")


def test_a_decode_heavy_load_ranks_more_decode_first() -> None:
    p = linear_profile(prefill_s_per_token=0.00005, decode_base_s=0.02, decode_per_seq_s=0.004)
    reqs = [SimRequest(i * 0.05, 128, 200) for i in range(40)]
    ranked = evaluate(reqs, candidates(4, [1], [8]), p, cores=4, slo_ttft=5.0, slo_tpot=0.05)
    best = ranked[0].deployment
    assert best.decode > best.prefill
    assert ranked[0].goodput >= ranked[-1].goodput
    text = table(ranked, 5.0, 0.05)
    assert text.count("\n") == len(ranked) + 3 and "| 1 |" in text


def test_both_trace_formats_load_and_scale(tmp_path: Path) -> None:
    azure = tmp_path / "azure.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,4808,10\n"
        "2023-11-16 18:15:50.9951690,3180,8\n"
    )
    reqs = load_workload(azure, time_scale=0.5, token_scale=0.25, max_input=1000)
    assert [r.input_len for r in reqs] == [1000, 795]
    assert reqs[1].arrival_s == pytest.approx((50.995169 - 46.68059) / 0.5)
    hashes = tmp_path / "trace.jsonl"
    hashes.write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}\n'
        '{"timestamp": 2000, "input_length": 600, "output_length": 8, "hash_ids": [1, 3]}\n'
    )
    reqs = load_workload(hashes, block_tokens=512)
    assert reqs[1].arrival_s == 2.0 and reqs[1].block_ids == (1, 3)
    assert reqs[0].block_tokens == 512
    with pytest.raises(TraceFormatError):
        load_workload(tmp_path / "missing.csv")
