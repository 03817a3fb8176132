"""Disaggregated serving against the in-process engine, at low load (one request at a time).

Starts a local cluster (redis-server, one KV store, one prefill, one decode,
the gateway; 1 torch thread per worker) and, in this process, the same engine
with 1 thread. The cluster is driven through ``baton bench``'s own request path
(so this is also the stack-overhead measurement of the bench issue). For each
prompt length it alternates the two, request by request, on identical prompts
(random token ids of exact length, greedy, ``ignore_eos``), and reports medians of:

- TTFT (first streamed token) and TPOT ((E2E - TTFT) / (tokens - 1)), and
  their ratios disaggregated / in-process (target <= 1.10);
- the KV transfer not hidden behind prefill compute, as a share of prefill
  compute: prefill's ``first token -> every layer committed in the store``
  over ``start of compute -> first token``, from its Prometheus histograms
  (target <= 5% for prompts >= 512 tokens);
- the handoff gap the client sees: the first-to-second token gap minus the
  median of the later gaps;
- prefill's own queue (arrival to start of compute) and compute (to first
  token), means from its histograms: what TTFT spends outside them is the
  stack's hops.

    python -m benchmarks.serving_bench --lengths 128 512 1024 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch

from benchmarks.results import save_json
from shared.bench.runner import Target, send
from shared.bench.workload import RequestSpec
from shared.config import CacheConfig, EngineConfig
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.launcher import LocalCluster, Topology
from shared.procs import PortPicker

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Sample:
    ttft: float
    tpot: float | None  # None for a one-token answer: no time between tokens
    handoff_gap: float


def timeline_sample(arrival: float, stamps: list[float]) -> Sample:
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    ttft = stamps[0] - arrival
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    later = statistics.median(gaps[1:]) if len(gaps) > 1 else 0.0
    return Sample(ttft, tpot, gaps[0] - later if gaps else 0.0)


def run_in_process(engine: Engine, prompt: list[int], max_tokens: int) -> Sample:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params, detokenize=False)
    stamps = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                stamps.append(time.perf_counter())
    return timeline_sample(t0, stamps)


class BenchClient:
    """``baton bench``'s own request path (shared.bench.runner.send), driven one request
    at a time from this synchronous loop."""

    def __init__(self, url: str, model: str = MODEL):
        self.target = Target(url, model)
        self.runner = asyncio.Runner()
        self.http = httpx.AsyncClient(timeout=600)

    def run(self, prompt: list[int], max_tokens: int) -> Sample:
        spec = RequestSpec(tuple(prompt), max_tokens)
        result, _ = self.runner.run(send(self.http, self.target, spec))
        if not result.ok:
            raise RuntimeError(f"request failed: {result.error}")
        return timeline_sample(result.start, list(result.chunk_times))

    def close(self) -> None:
        self.runner.run(self.http.aclose())
        self.runner.close()


def histogram_sums(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in ("compute", "exposed_transfer", "queue"):
        m = re.search(rf"^baton_prefill_{name}_seconds_sum (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--transport", choices=["ucx", "tcp"], default="ucx")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for every service (repeatable)"
    )
    args = ap.parse_args()
    if args.max_tokens < 2:
        ap.error("--max-tokens must be at least 2: TPOT needs two tokens")

    torch.set_num_threads(1)
    engine = Engine.from_config(
        EngineConfig(num_threads=1, cache=CacheConfig(kv_cache_bytes=1 << 29)), progress=False
    )
    rng = random.Random(0)
    logs = Path(tempfile.mkdtemp(prefix="baton-bench-"))

    def topology(redis_url: str) -> Topology:
        picker = PortPicker()
        return Topology(
            redis_url=redis_url,
            gateway_port=picker(),
            ports=picker,
            transport=args.transport,
            threads=1,
            kv_cache_gb=0.5,
            kvstore_gb=0.5,
            extra_env={"BATON_LOG_LEVEL": "warning", **dict(e.split("=", 1) for e in args.env)},
        )

    cluster = LocalCluster(topology, log_dir=logs).start()
    prefill_url = next(
        f"http://127.0.0.1:{s.http_port}" for s in cluster.specs if s.role == "prefill"
    )
    results = []
    try:
        client = BenchClient(cluster.gateway_url)
        try:
            # warm both paths (first-touch page faults, UCX wire-up)
            warm = [rng.randrange(100, 49000) for _ in range(64)]
            client.run(warm, 4)
            run_in_process(engine, warm, 4)
            for length in args.lengths:
                local: list[Sample] = []
                disagg: list[Sample] = []
                before = histogram_sums(prefill_url)
                for _ in range(args.repeats):
                    prompt = [rng.randrange(100, 49000) for _ in range(length)]
                    disagg.append(client.run(prompt, args.max_tokens))
                    local.append(run_in_process(engine, prompt, args.max_tokens))
                after = histogram_sums(prefill_url)
                compute = after["compute"] - before["compute"]
                exposed = after["exposed_transfer"] - before["exposed_transfer"]
                queue = after["queue"] - before["queue"]

                def med(xs: list[Sample], key: str) -> float | None:
                    got = [v for x in xs if (v := getattr(x, key)) is not None]
                    return statistics.median(got) if got else None

                row = {
                    "prompt_tokens": length,
                    "ttft_in_process_s": med(local, "ttft"),
                    "ttft_disagg_s": med(disagg, "ttft"),
                    "tpot_in_process_s": med(local, "tpot"),
                    "tpot_disagg_s": med(disagg, "tpot"),
                    "exposed_transfer_share": exposed / compute if compute else None,
                    "handoff_gap_s": med(disagg, "handoff_gap"),
                    # means over the disaggregated requests, from prefill's histograms
                    "prefill_queue_s": queue / args.repeats,
                    "prefill_compute_s": compute / args.repeats,
                    "samples": {
                        "in_process": [asdict(x) for x in local],
                        "disagg": [asdict(x) for x in disagg],
                    },
                }
                row["ttft_ratio"] = row["ttft_disagg_s"] / row["ttft_in_process_s"]
                row["tpot_ratio"] = row["tpot_disagg_s"] / row["tpot_in_process_s"]
                results.append(row)
                print(
                    f"{length:5d} tok  TTFT {row['ttft_in_process_s'] * 1e3:7.1f} -> "
                    f"{row['ttft_disagg_s'] * 1e3:7.1f} ms (x{row['ttft_ratio']:.3f})  "
                    f"TPOT {row['tpot_in_process_s'] * 1e3:6.1f} -> "
                    f"{row['tpot_disagg_s'] * 1e3:6.1f} ms (x{row['tpot_ratio']:.3f})  "
                    f"exposed transfer {100 * (row['exposed_transfer_share'] or 0):.2f}% "
                    f"of prefill  handoff gap {row['handoff_gap_s'] * 1e3:.1f} ms  "
                    f"(prefill queue {row['prefill_queue_s'] * 1e3:.1f} ms, "
                    f"compute {row['prefill_compute_s'] * 1e3:.1f} ms)",
                    flush=True,
                )
        finally:
            client.close()
    finally:
        cluster.stop()
    save_json(args.out, {"transport": args.transport, "rows": results})


if __name__ == "__main__":
    main()
