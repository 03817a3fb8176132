"""What a resumable stream costs: the same requests with and without
``stream_options.resumable`` against one ``baton up``, alternating round by round.

A resumable stream's events are appended to the event log in Redis before they are
sent (one script call per event) and produced by a task of the gateway. Printed:
TTFT and TPOT p50 per mode (the median over rounds) and the resumable / plain
ratio. Both modes in every round, in alternating order, so drift hits both.

    python -m benchmarks.resumable_bench --rounds 6 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.peers import MODEL, Running, baton_server
from shared.bench import workload as wl
from shared.bench.metrics import summarize
from shared.bench.runner import Target, run_open_loop


async def one_round(
    url: str, resumable: bool, args: argparse.Namespace, seed: int
) -> tuple[float, float]:
    times = wl.arrivals(args.num_prompts, float("inf"), 1.0, np.random.default_rng(seed))
    specs = wl.synthetic(args.num_prompts, args.input_len, args.output_len, times, seed)
    target = Target(url, MODEL, resumable=resumable)
    results, duration = await run_open_loop(target, specs, lambda: None, args.concurrency)
    s = summarize(results, duration)
    if s.failed:
        raise RuntimeError(f"{s.failed} requests failed: {s.errors}")
    return s.ttft.median, s.tpot.median


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baton-python", default=sys.executable)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=16, help="per round and mode")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("bench-results/resumable"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    running = Running(baton_server(args.baton_python), args.out / "baton.log")
    rows: dict[str, list[tuple[float, float]]] = {"plain": [], "resumable": []}
    try:
        print(f"baton up: ready in {running.wait_ready():.0f} s", flush=True)
        asyncio.run(one_round(running.url, False, args, seed=99))  # warm-up
        for r in range(args.rounds):
            order = ("plain", "resumable") if r % 2 == 0 else ("resumable", "plain")
            for mode in order:
                ttft, tpot = asyncio.run(one_round(running.url, mode == "resumable", args, r))
                rows[mode].append((ttft, tpot))
                print(
                    f"round {r} {mode}: TTFT {ttft * 1e3:.0f} ms, TPOT {tpot * 1e3:.1f} ms",
                    flush=True,
                )
    finally:
        running.stop()
    med = {m: tuple(statistics.median(x[i] for x in v) for i in (0, 1)) for m, v in rows.items()}
    ratio = med["resumable"][1] / med["plain"][1]
    (pt, pp), (rt, rp) = med["plain"], med["resumable"]
    print(
        f"TPOT p50 plain {pp * 1e3:.1f} ms, resumable {rp * 1e3:.1f} ms ({ratio:.3f}x); "
        f"TTFT p50 {pt * 1e3:.0f} / {rt * 1e3:.0f} ms"
    )
    (args.out / "resumable.json").write_text(json.dumps({"rounds": rows, "tpot_ratio": ratio}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
