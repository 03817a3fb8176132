"""``baton bench``: arguments -> workload -> runs -> JSON, summary, PNG."""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from shared.bench import prefix_trace, structured, tools
from shared.bench import workload as wl
from shared.bench.metrics import SLO, summarize
from shared.bench.report import RunReport, text_summary, write_json, write_png
from shared.bench.runner import Target, discover_model, run_conversations, run_open_loop
from shared.config import DEFAULT_BLOCK_SIZE
from shared.errors import InvalidRequestError

WORKLOADS = (
    "synthetic",
    "trace",
    "shared-prefix",
    "multi-turn",
    "prefix-trace",
    "structured",
    "tools",
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible endpoint (ours or another)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (no /v1)")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (default: none)")
    p.add_argument("--workload", choices=WORKLOADS, default="synthetic", help="what to send")
    p.add_argument("--num-prompts", type=int, default=50, help="requests per run")
    p.add_argument(
        "--request-rate",
        default="inf",
        help="req/s, or a comma list for a sweep (inf = all at once); open loop",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape; 1 = Poisson, inf = evenly spaced",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight (default: none)",
    )
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument(
        "--user-len", type=int, default=None, help="multi-turn: new tokens per later turn "
        "(default: input-len / 4)",
    )  # fmt: skip
    p.add_argument(
        "--think-time", type=float, default=0.0,
        help="multi-turn: mean pause (s, exponential) before each later turn",
    )  # fmt: skip
    p.add_argument(
        "--trace", type=Path, default=None,
        help="trace: Azure 2023 CSV; prefix-trace: JSONL with hash_ids (default: a synthetic "
        "one of --num-prompts requests at --request-rate)",
    )  # fmt: skip
    p.add_argument(
        "--trace-block-size", type=int, default=512, help="prefix-trace: tokens per hash id"
    )
    p.add_argument(
        "--cache-block-size", type=int, default=DEFAULT_BLOCK_SIZE,
        help="prefix-trace: the server's KV block size (the oracle counts whole blocks)",
    )  # fmt: skip
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: <1 stretches time")
    p.add_argument("--token-scale", type=float, default=1.0, help="trace: scales token counts")
    p.add_argument("--max-input", type=int, default=4096, help="trace: cap on prompt tokens")
    p.add_argument("--max-output", type=int, default=512, help="trace: cap on output tokens")
    p.add_argument(
        "--slo",
        default=None,
        help="goodput targets, e.g. ttft=2,tpot=0.2,e2e=30 (seconds; or 500ms; default: none)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--out", type=Path, default=Path("bench-results/bench.json"), help="results (JSON)"
    )
    p.add_argument("--plot", type=Path, default=None, help="PNG (default: next to --out)")
    p.add_argument("--label", default="", help="names the run (default: the workload)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidRequestError(f"--request-rate: not numbers: {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise InvalidRequestError("--request-rate values must be positive (or inf)")
    return rates


def build_workload(args: argparse.Namespace, rate: float) -> list[wl.RequestSpec]:
    n = args.num_prompts
    times = wl.arrivals(n, rate, args.burstiness, np.random.default_rng(args.seed))
    if args.workload == "prefix-trace":
        if args.trace is not None:
            hashed = prefix_trace.load(args.trace)
        else:
            synth_rate = rate if np.isfinite(rate) else 1.0
            hashed = prefix_trace.synthesize(
                n, block_tokens=args.trace_block_size, rate=synth_rate, seed=args.seed
            )
        return prefix_trace.replay(
            hashed,
            n=n,
            block_tokens=args.trace_block_size,
            cache_block=args.cache_block_size,
            time_scale=args.time_scale,
            max_input=args.max_input,
            max_output=args.max_output,
            seed=args.seed,
        )
    if args.workload == "trace":
        if args.trace is None:
            raise InvalidRequestError("--workload trace needs --trace FILE")
        rows = wl.load_trace(args.trace)
        return wl.from_trace(
            rows,
            n=n,
            time_scale=args.time_scale,
            token_scale=args.token_scale,
            max_input=args.max_input,
            max_output=args.max_output,
            seed=args.seed,
        )
    if args.workload == "shared-prefix":
        return wl.shared_prefix(
            n, args.prefix_len, args.input_len, args.output_len, times, args.seed
        )
    if args.workload == "multi-turn":
        conversations = max(1, n // args.turns)
        user_len = args.user_len or args.input_len // 4 or 1
        return wl.multi_turn(
            conversations, args.turns, args.input_len, user_len, args.output_len, times,
            args.seed, think_s=args.think_time,
        )  # fmt: skip
    if args.workload == "structured":
        return structured.structured(n, args.input_len, args.output_len, times, args.seed)
    if args.workload == "tools":
        return tools.tool_requests(n, args.output_len, times, args.seed)
    return wl.synthetic(n, args.input_len, args.output_len, times, args.seed)


async def _run(args: argparse.Namespace) -> int:
    if args.think_time < 0:
        raise InvalidRequestError("--think-time must not be negative")
    for name in ("num_prompts", "input_len", "output_len", "turns", "trace_block_size"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
    slo = SLO.parse(args.slo) if args.slo else None
    model = args.model
    if model is None:
        async with httpx.AsyncClient(timeout=30) as http:
            try:
                model = await discover_model(http, args.url)
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                raise InvalidRequestError(f"cannot list models at {args.url}: {exc}") from exc
    target = Target(args.url, model, args.api_key)
    replayed = args.workload == "trace" or (args.workload == "prefix-trace" and args.trace)
    rates = [None] if replayed else _rates(args.request_rate)
    runs: list[RunReport] = []
    for rate in rates:
        specs = build_workload(args, rate if rate is not None else float("inf"))
        label = args.label or args.workload
        label = f"{label} rate={rate:g}" if rate is not None else label
        bar = tqdm(total=len(specs), desc=label, disable=args.no_progress, unit="req")
        try:
            if args.workload == "multi-turn":
                results, duration = await run_conversations(target, specs, bar.update, args.seed)
            else:
                results, duration = await run_open_loop(
                    target, specs, bar.update, args.max_concurrency
                )
        finally:
            bar.close()
        validity = None
        if args.workload == "structured":
            validity = structured.check(specs, results).as_dict()
        elif args.workload == "tools":
            validity = tools.check(specs, results).as_dict()
        run = RunReport(label, rate, summarize(results, duration, slo), results, validity)
        runs.append(run)
        print(text_summary(run), flush=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config |= {"model": model, "func": None}
    write_json(args.out, config, runs)
    plot = args.plot or args.out.with_suffix(".png")
    write_png(plot, runs, title=f"{model} @ {args.url}")
    print(f"results: {args.out}  plot: {plot}")
    return 0 if all(r.summary.completed for r in runs) else 1


def run(args: argparse.Namespace) -> int:
    random.seed(args.seed)
    return asyncio.run(_run(args))
