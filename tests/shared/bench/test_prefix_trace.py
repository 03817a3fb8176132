"""Prefix-hash traces: the synthetic generator, the loader, token synthesis (equal ids,
equal tokens) and the infinite-cache oracle."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.bench import prefix_trace as pt
from shared.bench.metrics import CacheSummary, RequestResult
from shared.bench.workload import TraceFormatError


def row(
    t: float, ids: tuple[int, ...], length: int | None = None, out: int = 8
) -> pt.PrefixTraceRow:
    return pt.PrefixTraceRow(t, length if length is not None else 4 * len(ids), out, ids)


def test_a_synthetic_trace_round_trips_through_its_file(tmp_path: Path) -> None:
    rows = pt.synthesize(40, block_tokens=32, rate=5.0, seed=3)
    assert len(rows) == 40
    assert [r.timestamp_ms for r in rows] == sorted(r.timestamp_ms for r in rows)
    assert all(r.input_length == 32 * len(r.hash_ids) for r in rows)
    path = tmp_path / "trace.jsonl"
    pt.write(path, rows)
    assert pt.load(path) == rows
    # shared system prompts and growing sessions: most requests reuse something
    specs = pt.replay(rows, n=40, block_tokens=32)
    assert sum(1 for s in specs if s.oracle_cached) > 20


def test_equal_ids_give_equal_tokens_and_the_oracle_counts_chained_prefixes() -> None:
    rows = [
        row(0, (1, 2, 3)),
        row(10, (1, 2, 4)),  # shares two blocks
        row(20, (9, 2, 3)),  # id 2 again, after another prefix: not a shared prefix
        row(30, (1, 2, 3), length=12),  # the whole prompt was seen: the last token is computed
    ]
    specs = pt.replay(rows, n=4, block_tokens=4, cache_block=4, time_scale=10.0)
    a, b, c, _ = specs
    assert a.prompt[:8] == b.prompt[:8] and a.prompt[8:] != b.prompt[8:]
    assert c.prompt[4:8] == a.prompt[4:8]  # the same id, the same tokens
    assert [s.oracle_cached for s in specs] == [0, 8, 0, 8]
    assert [s.arrival for s in specs] == [0.0, 0.001, 0.002, 0.003]


def test_lengths_are_clamped_and_filled() -> None:
    short_ids = row(0, (1,), length=10)  # ids cover 4 tokens of 10: unique filler after
    specs = pt.replay([short_ids, short_ids], n=2, block_tokens=4, cache_block=2, max_input=9)
    assert [len(s.prompt) for s in specs] == [9, 9]
    assert specs[1].prompt[:4] == specs[0].prompt[:4] and specs[1].prompt[4:] != specs[0].prompt[4:]
    assert specs[1].oracle_cached == 4


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"timestamp": 0, "input_length": 4}',
        '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
    ],
)
def test_malformed_traces_are_refused(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl"):
        pt.load(path)


def test_backwards_timestamps_and_empty_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    pt.write(path, [row(5, (1,)), row(1, (2,))])
    with pytest.raises(TraceFormatError, match="backwards"):
        pt.load(path)
    path.write_text("\n")
    with pytest.raises(TraceFormatError, match="no requests"):
        pt.load(path)


def test_cache_summary_reads_hit_rate_oracle_and_ttft_by_turn() -> None:
    def result(
        prompt: int, cached: int, oracle: int | None, turn: int | None, ttft: float
    ) -> RequestResult:
        return RequestResult(
            prompt_tokens=prompt, output_tokens=2, start=0.0, chunk_times=(ttft, ttft + 0.1),
            end=ttft + 0.1, cached_tokens=cached, oracle_cached=oracle, turn=turn,
        )  # fmt: skip

    s = CacheSummary.of(
        [result(100, 0, 0, 0, 1.0), result(200, 150, 160, 1, 0.2), result(200, 160, 160, 1, 0.4)]
    )
    assert s is not None
    assert s.hit_rate == pytest.approx(310 / 500)
    assert s.oracle_hit_rate == pytest.approx(320 / 500)
    assert s.of_oracle == pytest.approx(310 / 320)
    assert s.ttft_by_turn[0].median == pytest.approx(1.0)
    assert s.ttft_by_turn[1].mean == pytest.approx(0.3)
    unreported = RequestResult(10, 1, 0.0, (0.1,), 0.1)
    assert CacheSummary.of([unreported]) is None
