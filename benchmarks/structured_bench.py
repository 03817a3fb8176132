"""What structured outputs cost: schema compile times, and TPOT with the constraint
against the same requests without it, at 1 and at 8 in flight, on one cluster.

For each concurrency it sends ``baton bench``'s structured workload (schemas of
:mod:`shared.bench.structured`, greedy and seeded alternating, each output checked
against its schema) and its twin: the same number of prompts of the same length
(fresh ones, so neither is served from the prefix cache), unconstrained, each with
``max_tokens`` equal to the length its constrained twin produced and EOS ignored.
The two alternate in blocks of twice the concurrency and decode the same token
counts at the same concurrency; their TPOT ratio is the price of the masks (target
<= 1.10).

Compile times are measured in this process on the gateway's own compiler: cold
(the first compile of each schema; the very first also builds llguidance's
tokenizer, shown apart) and cached (the schema seen before: what a repeated
schema costs the gateway and the engine).

    python -m benchmarks.structured_bench --requests 200 --out bench-results/structured.json
    python -m benchmarks.structured_bench --url http://127.0.0.1:8000   # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.bench_cluster import bench_cluster
from benchmarks.results import save_json
from shared.bench import structured
from shared.bench.metrics import RequestResult
from shared.bench.runner import Target, discover_model, run_open_loop
from shared.bench.workload import RequestSpec
from shared.config import default_cache_dir
from shared.engine.constraint import Constraint
from shared.engine.grammar import GrammarCompiler
from shared.model.tokenizer_loader import load_tokenizer


def compile_times(model: str | None) -> dict[str, Any]:
    m = load_tokenizer(model, cache_dir=default_cache_dir())
    tok = m.tokenizer
    compiler = GrammarCompiler(tok.to_json(), m.arch.vocab_size, tok.eos_token_ids)
    t0 = time.perf_counter()
    compiler.compile(Constraint.json_schema({"type": "boolean"}))
    tokenizer_s = time.perf_counter() - t0
    cold: dict[str, float] = {}
    cached: dict[str, float] = {}
    for name, schema in structured.SCHEMAS:
        constraint = Constraint.json_schema(schema)
        t0 = time.perf_counter()
        compiler.compile(constraint)
        cold[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.matcher(constraint)  # what each request makes: a copy of the template
        cached[name] = time.perf_counter() - t0
    return {"first_compile_with_tokenizer_s": tokenizer_s, "cold_s": cold, "cached_s": cached}


def tpots(results: list[RequestResult]) -> list[float]:
    return [t for r in results if (t := r.tpot) is not None]


def side(results: list[RequestResult], seconds: float) -> dict[str, float]:
    ttft = [t for r in results if (t := r.ttft) is not None]
    return {
        "ttft_median_s": statistics.median(ttft),
        "tpot_median_s": statistics.median(tpots(results)),
        "tpot_mean_s": statistics.mean(tpots(results)),
        "output_tokens": sum(r.output_tokens for r in results),
        "failed": sum(not r.ok for r in results),
        "seconds": seconds,
    }


async def pair(
    target: Target, n: int, input_len: int, max_tokens: int, in_flight: int, seed: int
) -> dict[str, Any]:
    """Constrained requests and their unconstrained twins in alternating blocks of
    ``2 * in_flight``, so drift in the host's speed falls on both alike."""
    specs = structured.structured(n, input_len, max_tokens, [0.0] * n, seed)
    fresh = structured.structured(n, input_len, max_tokens, [0.0] * n, seed + 1)
    constrained: list[RequestResult] = []
    free: list[RequestResult] = []
    took = free_took = 0.0
    block = 2 * in_flight
    for start in range(0, n, block):
        got, seconds = await run_open_loop(
            target, specs[start : start + block], lambda: None, in_flight
        )
        constrained += got
        took += seconds
        twins = [
            RequestSpec(f.prompt, max(r.output_tokens, 1), 0.0, seed=s.seed)
            for s, f, r in zip(specs[start:], fresh[start:], got, strict=False)
            if r.ok
        ]
        got, seconds = await run_open_loop(target, twins, lambda: None, in_flight)
        free += got
        free_took += seconds
    validity = structured.check(specs, constrained)
    c, u = tpots(constrained), tpots(free)
    return {
        "in_flight": in_flight,
        "requests": n,
        "validity": validity.as_dict(),
        "constrained": side(constrained, took),
        "unconstrained": side(free, free_took),
        "tpot_ratio_median": statistics.median(c) / statistics.median(u),
        "tpot_ratio_mean": statistics.mean(c) / statistics.mean(u),
    }


async def measure(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        model = await discover_model(http, url)
    target = Target(url, model)
    warm = structured.structured(len(structured.SCHEMAS), 32, 64, [0.0] * 11, args.seed + 7)
    await run_open_loop(target, warm, lambda: None, 4)
    await run_open_loop(target, [replace(w, structured=None) for w in warm], lambda: None, 4)
    rows: list[dict[str, Any]] = []
    for in_flight in args.in_flight:
        seed = args.seed + 1000 * len(rows)  # fresh prompts each run: no prefix cache
        row = await pair(target, args.requests, args.input_len, args.output_len, in_flight, seed)
        rows.append(row)
        v = row["validity"]
        print(
            f"{in_flight:2d} in flight: {v['valid']}/{v['requests']} valid "
            f"({v['cut_by_max_tokens']} cut, invalid {v['invalid']}); TPOT median "
            f"{row['constrained']['tpot_median_s'] * 1e3:.2f} ms constrained vs "
            f"{row['unconstrained']['tpot_median_s'] * 1e3:.2f} ms free: "
            f"{row['tpot_ratio_median']:.3f}x (mean {row['tpot_ratio_mean']:.3f}x); TTFT "
            f"median {row['constrained']['ttft_median_s'] * 1e3:.1f} vs "
            f"{row['unconstrained']['ttft_median_s'] * 1e3:.1f} ms",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start a cluster)")
    ap.add_argument("--model", default=None, help="for the compile times (default: embedded)")
    ap.add_argument("--requests", type=int, default=110, help="per concurrency")
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=384, help="max_tokens")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    compiled = compile_times(args.model)
    cold = sorted(compiled["cold_s"].values())
    print(
        f"compile: first (with llguidance's tokenizer) "
        f"{compiled['first_compile_with_tokenizer_s'] * 1e3:.1f} ms; cold per schema "
        f"median {statistics.median(cold) * 1e3:.2f} ms, max {cold[-1] * 1e3:.2f} ms; cached "
        f"median {statistics.median(compiled['cached_s'].values()) * 1e6:.0f} us",
        flush=True,
    )
    with ExitStack() as stack:
        url = args.url
        if url is None:
            local = stack.enter_context(
                bench_cluster(args.logs, "structured", {}, dtype=args.dtype)
            )
            url = local.gateway_url
        rows = asyncio.run(measure(url, args))
    save_json(args.out, {"compile": compiled, "runs": rows, "args": vars(args) | {"out": None}})


if __name__ == "__main__":
    main()
