"""A lone prompt served by the cluster ``baton up`` starts, against ``baton generate``'s
engine at the machine's thread count, same prompts, same run.

The cluster is ``baton up``'s default (one prefill, one decode, one KV store, the
gateway; 1 torch thread per worker, prefill elastic up to every CPU; UCX, or TCP
with ``--transport tcp``). A light client (``baton bench``'s own request path,
one streamed request at a time, unique token-id prompts) and the in-process
engine alternate request by request. For each prompt length it prints the median
TTFT of both and their ratio (target <= 1.1), and where the served TTFT went, from
the prefill instance's histograms: its queue (arrival to start of compute), its
compute (to the first token), and the rest (gateway, hops, the first token's way
back); and how much of prefill's step time ran on how many threads.

    python -m benchmarks.served_prefill --lengths 512 2048 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.bench_cluster import bench_cluster
from benchmarks.results import save_json
from benchmarks.serving_bench import MODEL, BenchClient
from shared.config import CacheConfig, EngineConfig
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams

# between one side's request and the other's: OpenMP's workers spin for a while after
# a step (~10 ms of a core here), which the other side's request would otherwise pay
SETTLE_S = 0.1


def in_process_ttft(engine: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request(prompt, params, detokenize=False)
    first = None
    while engine.has_unfinished():
        outs = engine.step()
        if first is None and any(o.new_token_ids for o in outs):
            first = time.perf_counter()
    if first is None:
        raise RuntimeError("the engine produced no token")
    return first - t0


def prefill_figures(url: str) -> dict[str, float]:
    """Cumulative sums from the prefill instance's metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for name in ("compute", "queue"):
        m = re.search(rf"^baton_prefill_{name}_seconds_sum (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    m = re.search(r"^baton_engine_step_seconds_sum (\S+)$", text, re.M)
    out["steps"] = float(m.group(1)) if m else 0.0
    for m in re.finditer(
        r'^baton_engine_thread_seconds_total\{threads="(\d+)"\} (\S+)$', text, re.M
    ):
        out[f"threads_{m.group(1)}"] = float(m.group(2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--output-tokens", type=int, default=2,
        help="tokens each served request generates (peers.py's workloads: 128)",
    )  # fmt: skip
    ap.add_argument("--model", default=None, help="a model name Baton pulls, or a path")
    ap.add_argument("--transport", choices=["ucx", "tcp"], default="ucx")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument(
        "--max-threads", type=int, default=None, help="prefill's elastic ceiling (default: CPUs)"
    )
    ap.add_argument("--logs", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for every service (repeatable)"
    )
    args = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    torch.set_num_threads(cpus)
    engine = Engine.from_config(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            num_threads=cpus,
            cache=CacheConfig(kv_cache_bytes=1 << 29, enable_prefix_caching=False),
        ),
        progress=False,
    )
    rng = random.Random(0)
    env = dict(e.split("=", 1) for e in args.env)
    rows: list[dict[str, Any]] = []
    with bench_cluster(
        args.logs, "served-prefill", env, transport=args.transport, dtype=args.dtype,
        threads=args.threads, max_threads=args.max_threads or cpus, model=args.model,
    ) as local:  # fmt: skip
        prefill = next(
            f"http://127.0.0.1:{s.http_port}" for s in local.specs if s.role == "prefill"
        )
        client = BenchClient(local.gateway_url, args.model or MODEL)
        try:
            warm = [rng.randrange(100, 49000) for _ in range(256)]
            client.run(warm, 2)
            in_process_ttft(engine, warm)
            for length in args.lengths:
                served: list[float] = []
                local_ttft: list[float] = []
                before = prefill_figures(prefill)
                for _ in range(args.repeats):
                    prompt = [rng.randrange(100, 49000) for _ in range(length)]
                    served.append(client.run(prompt, args.output_tokens).ttft)
                    time.sleep(SETTLE_S)
                    prompt = [rng.randrange(100, 49000) for _ in range(length)]
                    local_ttft.append(in_process_ttft(engine, prompt))
                    time.sleep(SETTLE_S)
                after = prefill_figures(prefill)
                spent = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / args.repeats for k in after}
                row = {
                    "prompt_tokens": length,
                    "served_ttft_s": statistics.median(served),
                    "generate_ttft_s": statistics.median(local_ttft),
                    "prefill_queue_s": spent.pop("queue"),
                    "prefill_compute_s": spent.pop("compute"),
                    "prefill_steps_s": spent.pop("steps"),
                    "prefill_step_s_by_threads": spent,
                    "samples": {"served": served, "generate": local_ttft},
                }
                row["ratio"] = row["served_ttft_s"] / row["generate_ttft_s"]
                row["outside_prefill_s"] = (
                    row["served_ttft_s"] - row["prefill_queue_s"] - row["prefill_compute_s"]
                )
                rows.append(row)
                by_threads = ", ".join(
                    f"{k.split('_')[1]} threads {v * 1e3:.0f} ms" for k, v in sorted(spent.items())
                )
                print(
                    f"{length:5d} tok  served TTFT {row['served_ttft_s'] * 1e3:7.1f} ms  "
                    f"generate ({cpus} threads) {row['generate_ttft_s'] * 1e3:7.1f} ms  "
                    f"ratio {row['ratio']:.2f}  | prefill queue "
                    f"{row['prefill_queue_s'] * 1e3:.1f} ms, compute "
                    f"{row['prefill_compute_s'] * 1e3:.1f} ms (steps "
                    f"{row['prefill_steps_s'] * 1e3:.1f} ms: {by_threads}), elsewhere "
                    f"{row['outside_prefill_s'] * 1e3:.1f} ms",
                    flush=True,
                )
        finally:
            client.close()
    save_json(args.out, {"cpus": cpus, "transport": args.transport, "rows": rows})


if __name__ == "__main__":
    main()
