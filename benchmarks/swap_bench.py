"""Swapping against recompute-preemption, with the decode KV pool at a fraction of the
working set of a steady load.

``baton up`` is started once per mode with ``--kv-cache-gb`` set so the pool holds
``--pool-share`` of what the requests in flight need at their longest:

- ``recompute``: ``--preemption-mode recompute``, the baseline;
- ``swap``: ``--preemption-mode auto``, swap to host memory or recompute by the
  measured cost model;
- ``spill``: ``auto`` with no host swap space (``--swap-space-gb 0``), so every
  preempted request's KV stays in the KV store (its replicated blocks) and comes
  back from there.

The same closed-loop load (the same prompts, forced output lengths, greedy) runs
against each. Reported per mode: goodput under the SLOs (requests/s meeting both),
TTFT and TPOT medians, output throughput, and the decode instance's swap and
preemption counters; then each mode's goodput over recompute's and whether every
request's tokens were identical in all runs.

    python -m benchmarks.swap_bench --out bench-results/swap
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import secrets
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
import numpy as np

from benchmarks.peers import MODEL, Running, baton_server
from shared.bench import workload as wl
from shared.bench.metrics import SLO, RequestResult, summarize
from shared.bench.runner import Target, send
from shared.cluster.auth import SECRET_HEADER
from shared.kv.layout import KVLayout
from shared.procs import PortPicker

# SmolLM2-135M: 30 layers, 3 KV heads of 64; bf16 where the CPU computes it natively
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16")


@dataclass(frozen=True)
class Outcome:
    mode: str
    goodput: float
    met_slo: int  # requests meeting both SLOs
    duration_s: float
    ttft_p50: float
    tpot_p50: float
    output_tok_s: float
    failed: int
    decode_stats: dict[str, float]


def pool_gb(args: argparse.Namespace, bytes_per_token: int) -> float:
    working_set = args.concurrency * (args.input_len + args.output_len) * bytes_per_token
    return args.pool_share * working_set / (1 << 30)


async def closed_loop(
    url: str, args: argparse.Namespace
) -> tuple[list[RequestResult], list[list[int]], float]:
    times = wl.arrivals(args.num_prompts, math.inf, 1.0, np.random.default_rng(0))
    specs = wl.synthetic(args.num_prompts, args.input_len, args.output_len, times, seed=0)
    target = Target(url, MODEL)
    gate = asyncio.Semaphore(args.concurrency)
    results: list[tuple[RequestResult, list[int]] | None] = [None] * len(specs)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(i: int) -> None:
            async with gate:
                results[i] = await send(http, target, specs[i])

        await asyncio.gather(*(one(i) for i in range(len(specs))))
        duration = loop.time() - t0
    done = [r for r in results if r is not None]
    return [r for r, _ in done], [t for _, t in done], duration


def decode_stats(port: int, secret: str) -> dict[str, float]:
    r = httpx.get(f"http://127.0.0.1:{port}/stats", headers={SECRET_HEADER: secret}, timeout=10)
    r.raise_for_status()
    return {k: float(v) for k, v in r.json().items()}


MODES: dict[str, list[str]] = {
    "recompute": ["--preemption-mode", "recompute"],
    "swap": ["--preemption-mode", "auto"],
    "spill": ["--preemption-mode", "auto", "--swap-space-gb", "0"],
}
STATS = ("preemptions", "swaps_out", "swaps_in", "spills_out", "spills_in")


def run_mode(
    mode: str, args: argparse.Namespace, gb: float, slo: SLO
) -> tuple[Outcome, list[list[int]]]:
    ports = PortPicker()
    secret, decode_port = secrets.token_hex(16), ports()
    extra = [
        "--kv-cache-gb", f"{gb:.4f}", *MODES[mode], "--decode-port",
        str(decode_port), "--prefill-port", str(ports()), "--kvstore-port", str(ports()),
    ]  # fmt: skip
    server = baton_server(args.python, f"preemption {mode}", extra, ports)
    server = replace(server, env={**server.env, "BATON_CLUSTER_SECRET": secret})
    running = Running(server, args.out / f"baton-{mode}.log")
    try:
        running.wait_ready()
        results, tokens, duration = asyncio.run(closed_loop(running.url, args))
        stats = decode_stats(decode_port, secret)
    finally:
        running.stop()
    s = summarize(results, duration, slo)
    goodput = s.goodput or 0.0
    outcome = Outcome(
        mode, goodput, round(goodput * duration), duration, s.ttft.median, s.tpot.median,
        s.output_throughput, s.failed,
        {k: stats.get(k, 0.0) for k in STATS},
    )  # fmt: skip
    print(outcome, flush=True)
    return outcome, tokens


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    import sys

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--pool-share", type=float, default=0.5, help="decode pool / working set")
    p.add_argument("--slo-ttft", type=float, default=10.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="modes to run; recompute (the baseline) always runs first",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results/swap"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gb = pool_gb(args, LAYOUT.bytes_per_token)
    slo = SLO(ttft=args.slo_ttft, tpot=args.slo_tpot)
    print(f"decode pool {gb:.3f} GiB ({args.pool_share:.0%} of the working set)", flush=True)
    base, base_tokens = run_mode("recompute", args, gb, slo)
    body: dict[str, object] = {"pool_gb": gb, "recompute": asdict(base)}
    identical = all(len(t) == args.output_len for t in base_tokens)
    for mode in (m for m in args.modes if m != "recompute"):
        outcome, tokens = run_mode(mode, args, gb, slo)
        same = tokens == base_tokens
        identical = identical and same
        ratio = outcome.goodput / base.goodput if base.goodput else math.inf
        body[mode] = asdict(outcome) | {"goodput_ratio": ratio, "identical_tokens": same}
        print(f"goodput {mode} / recompute: {ratio:.2f}x; identical tokens: {same}", flush=True)
    body["identical_tokens"] = identical
    (args.out / "swap.json").write_text(json.dumps(body, indent=1))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
