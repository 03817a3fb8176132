"""Disaggregated vs colocated on the same machine, same cores, same total threads.

Disaggregated: prefill pinned to core 0 and decode to core 1, 1 torch thread each
(plus the KV store and gateway, unpinned). Colocated: one engine on cores 0,1 with 2
threads, mixed batching (chunked prefill shares steps with running decodes).

Experiments (each runs on both deployments, one after the other):

- ``interference``: a steady stream of short decode-heavy requests (evenly spaced by
  default, so the decode batch size holds still; ``--short-burstiness 1`` makes it
  Poisson) while long-prompt requests arrive every few seconds (``--long-every 0``:
  none, the control run); reports ITL and TPOT of the short requests (p50, p99) -
  DistServe/Splitwise predict colocated ITL spikes whenever a long prefill runs;
  target: disaggregated p99 ITL <= 1.5x its own p50.
- ``trace``: the Azure 2023 conversation trace, scaled to this machine; goodput at
  the same SLOs and TTFT/TPOT percentiles.

    python -m benchmarks.deployments interference --duration 60
    python -m benchmarks.deployments trace --num-prompts 60 --time-scale 0.05 --token-scale 0.25
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np

from shared.bench import workload as wl
from shared.bench.metrics import SLO, Distribution, RequestResult, summarize
from shared.bench.report import RunReport, text_summary, write_json, write_png
from shared.bench.runner import Target, run_open_loop
from shared.launcher import LocalCluster, Topology
from shared.procs import PortPicker

MODEL = "SmolLM2-135M-Instruct"
TRACE = Path(__file__).resolve().parents[2] / "shared/workloads/azure-2023"


def topology(
    colocated: bool, transport: str, support: str | None, dtype: str, split_io: bool
) -> Callable[[str], Topology]:
    support_cpus = {"kvstore": support, "gateway": support} if support else {}
    io_cpus = "0" if split_io else "1"

    def make(redis_url: str) -> Topology:
        picker = PortPicker()
        base = Topology(
            redis_url=redis_url,
            gateway_port=picker(),
            ports=picker,
            transport=transport,
            threads=1,
            kv_cache_gb=1.0,
            kvstore_gb=1.0,
            # decode's engine thread has core 1 to itself; its HTTP and KV I/O share core 0
            cpus={"prefill": "0", "decode": io_cpus, **support_cpus},
            engine_cpus={"decode": "1"},
            extra_env={"BATON_LOG_LEVEL": "warning", "BATON_DTYPE": dtype},
        )
        if colocated:
            return replace(
                base, prefill=0, decode=0, kvstore=0, colocated=1, threads=2,
                cpus={"colocated": "0,1", **support_cpus},
            )  # fmt: skip
        return base

    return make


def interference_specs(args: argparse.Namespace) -> list[wl.RequestSpec]:
    rng = np.random.default_rng(args.seed)
    n_short = int(args.duration * args.short_rate)
    short = wl.synthetic(
        n_short,
        args.short_input,
        args.short_output,
        wl.arrivals(n_short, args.short_rate, args.short_burstiness, rng),
        seed=args.seed,
    )
    n_long = int(args.duration / args.long_every) if args.long_every > 0 else 0
    times = [args.long_every * (i + 0.5) for i in range(n_long)]
    long = wl.synthetic(n_long, args.long_input, args.long_output, times, seed=args.seed + 1)
    return sorted(short + long, key=lambda s: s.arrival)


def short_only(results: list[RequestResult], short_input: int) -> list[RequestResult]:
    return [r for r in results if r.prompt_tokens == short_input]


async def run_one(url: str, specs: list[wl.RequestSpec]) -> tuple[list[RequestResult], float]:
    return await run_open_loop(Target(url, MODEL), specs, lambda: None)


def decode_step_buckets(cluster: LocalCluster) -> dict[str, float]:
    """Cumulative counts of the token-phase engine's step durations (its /metrics), to
    tell stalls inside the engine from stalls on the way to the client."""
    spec = next(s for s in cluster.specs if s.role in ("decode", "colocated"))
    text = httpx.get(f"http://127.0.0.1:{spec.http_port}/metrics", timeout=10).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'^baton_engine_step_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M
        )
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("experiment", choices=["interference", "trace"])
    ap.add_argument("--deployments", default="disaggregated,colocated")
    ap.add_argument("--transport", default="ucx")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--decode-io-with-engine",
        action="store_true",
        help="run decode's HTTP/KV I/O on the engine's core 1 (default: on core 0)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--support-cpus",
        default=None,
        help="pin the KV store, the gateway and this load generator, e.g. 0",
    )
    # interference
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--short-rate", type=float, default=1.0)
    ap.add_argument(
        "--short-burstiness",
        type=float,
        default=float("inf"),
        help="gamma shape of the short requests' gaps: inf = evenly spaced, 1 = Poisson",
    )
    ap.add_argument("--short-input", type=int, default=32)
    ap.add_argument("--short-output", type=int, default=48)
    ap.add_argument("--long-every", type=float, default=10.0, help="seconds; 0 = no long prompts")
    ap.add_argument("--long-input", type=int, default=1536)
    ap.add_argument("--long-output", type=int, default=4)
    # trace
    ap.add_argument("--trace", type=Path, default=TRACE / "AzureLLMInferenceTrace_conv.csv")
    ap.add_argument("--num-prompts", type=int, default=60)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--token-scale", type=float, default=0.25)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--slo", default="ttft=3,tpot=0.25")
    args = ap.parse_args()
    out = args.out or Path(f"bench-results/{args.experiment}.json")
    slo = SLO.parse(args.slo)

    if args.experiment == "interference":
        specs = interference_specs(args)
    else:
        rows = wl.load_trace(args.trace)
        specs = wl.from_trace(
            rows,
            n=args.num_prompts,
            time_scale=args.time_scale,
            token_scale=args.token_scale,
            max_input=args.max_input,
            max_output=args.max_output,
            seed=args.seed,
        )
    random.seed(args.seed)
    if args.support_cpus:  # the load generator is support work too
        os.sched_setaffinity(0, {int(c) for c in args.support_cpus.split(",")})
    runs: list[RunReport] = []
    extra: dict[str, dict[str, object]] = {}
    for name in args.deployments.split(","):
        colocated = name == "colocated"
        logs = Path(tempfile.mkdtemp(prefix=f"baton-{name}-"))
        cluster = LocalCluster(
            topology(
                colocated,
                args.transport,
                args.support_cpus,
                args.dtype,
                not args.decode_io_with_engine,
            ),
            log_dir=logs,
        ).start()
        try:
            # warm-up: first-touch page faults, connections
            asyncio.run(run_one(cluster.gateway_url, wl.synthetic(2, 64, 4, [0.0, 0.0])))
            results, duration = asyncio.run(run_one(cluster.gateway_url, specs))
            steps = decode_step_buckets(cluster)
        finally:
            cluster.stop()
        focus = (
            short_only(results, args.short_input) if args.experiment == "interference" else results
        )
        run = RunReport(name, None, summarize(focus, duration, slo), focus)
        runs.append(run)
        itl = Distribution.of([g for r in focus for g in r.itls])
        extra[name] = {
            "itl_p99_over_p50": itl.p99 / itl.median if itl.count else None,
            "decode_engine_steps_by_duration": steps,
            "all_requests": summarize(results, duration, slo).as_dict(),
        }
        print(text_summary(run))
        print(f"{name}: p99/p50 ITL = {extra[name]['itl_p99_over_p50']}", flush=True)
    write_json(out, {**{k: str(v) for k, v in vars(args).items()}, "extra": extra}, runs)
    write_png(out.with_suffix(".png"), runs, title=f"{args.experiment}: disaggregated vs colocated")
    print(json.dumps(extra, indent=1, default=str)[:2000])
    print(f"results: {out}")


if __name__ == "__main__":
    main()
