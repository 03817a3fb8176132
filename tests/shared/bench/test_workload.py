"""Workload generators and the trace loader (which rejects malformed files clearly)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shared.bench import workload as wl

# ../shared beside the project root holds the traces (for development and CI alike)
TRACE_DIR = Path(__file__).resolve().parents[4] / "shared" / "workloads" / "azure-2023"


def test_poisson_and_gamma_arrivals_have_the_asked_rate() -> None:
    rng = np.random.default_rng(0)
    for burstiness in (1.0, 0.25, 4.0):
        times = wl.arrivals(4000, rate=5.0, burstiness=burstiness, rng=rng)
        assert times[0] == 0.0 and times == sorted(times)
        assert 4000 / times[-1] == pytest.approx(5.0, rel=0.1)
    gaps = np.diff(wl.arrivals(4000, 5.0, 0.25, np.random.default_rng(1)))
    regular = np.diff(wl.arrivals(4000, 5.0, 4.0, np.random.default_rng(1)))
    assert gaps.std() > regular.std()  # burstier
    assert wl.arrivals(3, float("inf"), 1.0, rng) == [0.0, 0.0, 0.0]
    assert wl.arrivals(4, 2.0, float("inf"), rng) == [0.0, 0.5, 1.0, 1.5]  # steady


def test_exact_lengths_shared_prefix_and_turns() -> None:
    specs = wl.synthetic(5, 37, 9, [0.0] * 5)
    assert [len(s.prompt) for s in specs] == [37] * 5 and specs[0].max_tokens == 9
    shared = wl.shared_prefix(3, 20, 5, 4, [0.0] * 3)
    assert all(s.prompt[:20] == shared[0].prompt[:20] for s in shared)
    assert len({s.prompt[20:] for s in shared}) == 3
    turns = wl.multi_turn(2, 3, 30, 6, 4, [0.0, 1.0])
    assert [(s.conversation, len(s.prompt)) for s in turns] == [
        (0, 30), (0, 6), (0, 6), (1, 30), (1, 6), (1, 6),
    ]  # fmt: skip


def test_real_azure_traces_load_and_scale() -> None:
    for name in ("AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv"):
        rows = wl.load_trace(TRACE_DIR / name)
        assert len(rows) > 1000 and rows[0].offset_s == 0.0
        specs = wl.from_trace(rows, n=50, time_scale=0.5, token_scale=0.1, max_input=300)
        assert len(specs) == 50
        assert specs[10].arrival == pytest.approx(rows[10].offset_s / 0.5)
        assert all(1 <= len(s.prompt) <= 300 and s.max_tokens >= 1 for s in specs)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "header"),
        ("a,b,c\n", "header"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12\n", ":2: expected 3"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", ":2:"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,2\n", ":2:"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,2\n", "out of range"),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46,5,2\n2023-11-16 18:15:40,5,2\n",
            "backwards",
        ),
    ],
)
def test_malformed_traces_are_rejected(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(content)
    with pytest.raises(wl.TraceFormatError, match=message):
        wl.load_trace(path)


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(wl.TraceFormatError, match="cannot read"):
        wl.load_trace(tmp_path / "nope.csv")
