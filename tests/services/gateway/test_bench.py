"""``baton bench`` end to end against the running local cluster: a well-formed result
file (every request accounted for, metrics consistent with the raw timelines) and a PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.services.conftest import Cluster


def test_bench_writes_results_and_plot(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    proc = subprocess.run(
        [
            sys.executable, "-m", "shared.cli", "bench", "--url", cluster.url,
            "--num-prompts", "6", "--input-len", "40", "--output-len", "5",
            "--request-rate", "4,inf", "--slo", "ttft=60,tpot=10", "--out", str(out),
            "--no-progress",
        ],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TTFT" in proc.stdout and "goodput" in proc.stdout
    body = json.loads(out.read_text())
    assert body["config"]["model"] == "SmolLM2-135M-Instruct"
    assert [r["request_rate"] for r in body["runs"]] == [4.0, "inf"]
    for run in body["runs"]:
        s = run["summary"]
        assert s["completed"] == 6 and s["failed"] == 0
        requests = run["requests"]
        assert len(requests) == 6
        assert all(r["output_tokens"] == 5 and r["prompt_tokens"] == 40 for r in requests)
        assert all(len(r["chunk_times"]) == 5 for r in requests)
        ttfts = sorted(r["ttft"] for r in requests)
        assert s["ttft"]["count"] == 6
        assert abs(s["ttft"]["mean"] - sum(ttfts) / 6) < 1e-9
        assert s["goodput"] == s["request_throughput"]  # generous SLOs: all met
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def run_bench(cluster: Cluster, out: Path, *args: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    proc = subprocess.run(
        [sys.executable, "-m", "shared.cli", "bench", "--url", cluster.url, "--out", str(out),
         "--no-progress", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    body: dict[str, Any] = json.loads(out.read_text())
    return body


def test_multi_turn_bench_reports_reuse_and_ttft_by_turn(cluster: Cluster, tmp_path: Path) -> None:
    body = run_bench(
        cluster, tmp_path / "mt.json", "--workload", "multi-turn", "--num-prompts", "6",
        "--turns", "3", "--input-len", "80", "--user-len", "20", "--output-len", "20",
        "--think-time", "0.05", "--seed", "5",
    )  # fmt: skip
    (run,) = body["runs"]
    cache = run["summary"]["cache"]
    assert set(cache["ttft_by_turn"]) == {"0", "1", "2"}
    by_turn: dict[int, list[dict[str, Any]]] = {}
    for r in run["requests"]:
        by_turn.setdefault(r["turn"], []).append(r)
    # a later turn reuses the whole earlier prompt and the answer decode computed
    for r in by_turn[1] + by_turn[2]:
        assert r["cached_tokens"] >= (r["prompt_tokens"] - 20 - 20) // 16 * 16
    assert cache["hit_rate"] > 0.4


def test_prefix_trace_bench_reads_reuse_against_the_oracle(
    cluster: Cluster, tmp_path: Path
) -> None:
    body = run_bench(
        cluster, tmp_path / "pt.json", "--workload", "prefix-trace", "--num-prompts", "8",
        "--trace-block-size", "32", "--request-rate", "2", "--max-output", "4", "--seed", "2",
    )  # fmt: skip
    (run,) = body["runs"]
    cache = run["summary"]["cache"]
    assert cache["oracle_hit_rate"] > 0 and cache["hit_rate"] > 0
    assert all(r["oracle_cached"] is not None for r in run["requests"])
