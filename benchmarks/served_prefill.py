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

``--busy-cores N`` runs it all beside N processes that spin (a load generator on
the same machine, as aiperf's timing loop is); the in-process engine then also
runs on the cores they leave, and the ratio is against the faster of the two.

    python -m benchmarks.served_prefill --lengths 512 2048 --repeats 5
    python -m benchmarks.served_prefill --lengths 512 --busy-cores 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.bench_cluster import bench_cluster
from benchmarks.results import save_json
from benchmarks.serving_bench import MODEL, BenchClient
from shared.config import CacheConfig, EngineConfig, resolve_dtype
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams

# between one side's request and the other's: OpenMP's workers spin for a while after
# a step (~10 ms of a core here), which the other side's request would otherwise pay,
# and a prefill that saw another process computing until it came leaves it a core
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
    ap.add_argument("--dtype", default="auto", help="as baton up takes it (auto: the host's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument(
        "--max-threads", type=int, default=None, help="prefill's elastic ceiling (default: CPUs)"
    )
    ap.add_argument("--logs", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for every service (repeatable)"
    )
    ap.add_argument(
        "--busy-cores", type=int, default=0, help="processes spinning beside it all the while"
    )
    args = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    torch.set_num_threads(cpus)
    engine = Engine.from_config(
        EngineConfig(
            model=args.model,
            dtype=resolve_dtype(args.dtype, "cpu"),
            num_threads=cpus,
            cache=CacheConfig(kv_cache_bytes=1 << 29, enable_prefix_caching=False),
        ),
        progress=False,
    )
    rng = random.Random(0)
    env = dict(e.split("=", 1) for e in args.env)
    rows: list[dict[str, Any]] = []
    # the in-process engine's thread counts: the machine's, and the cores spinners leave
    counts = sorted({cpus, max(1, cpus - args.busy_cores)}, reverse=True)
    with spinning(args.busy_cores), bench_cluster(
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
            time.sleep(SETTLE_S)  # the served side's first step would see it computing
            for length in args.lengths:
                served: list[float] = []
                local_ttft: dict[int, list[float]] = {n: [] for n in counts}
                before = prefill_figures(prefill)
                for _ in range(args.repeats):
                    prompt = [rng.randrange(100, 49000) for _ in range(length)]
                    served.append(client.run(prompt, args.output_tokens).ttft)
                    time.sleep(SETTLE_S)
                    for n in counts:
                        engine.set_num_threads(n)
                        prompt = [rng.randrange(100, 49000) for _ in range(length)]
                        local_ttft[n].append(in_process_ttft(engine, prompt))
                        time.sleep(SETTLE_S)
                after = prefill_figures(prefill)
                spent = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / args.repeats for k in after}
                by_count = {n: statistics.median(t) for n, t in local_ttft.items()}
                best = min(by_count, key=lambda n: by_count[n])
                row = {
                    "prompt_tokens": length,
                    "busy_cores": args.busy_cores,
                    "served_ttft_s": statistics.median(served),
                    "generate_ttft_s": by_count[best],
                    "generate_threads": best,
                    "generate_ttft_s_by_threads": by_count,
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
                generate = ", ".join(f"{n} threads {t * 1e3:.1f} ms" for n, t in by_count.items())
                print(
                    f"{length:5d} tok  served TTFT {row['served_ttft_s'] * 1e3:7.1f} ms  "
                    f"generate ({generate})  "
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


@contextlib.contextmanager
def spinning(count: int) -> Iterator[None]:
    """``count`` processes that keep a core busy each, for the block."""
    spin = "while True:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
