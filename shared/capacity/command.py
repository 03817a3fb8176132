"""``baton profile`` and ``baton plan``: arguments -> measurement or simulation -> output."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from shared.cli import from_settings, settings_default
from shared.config import BatonSettings, default_cache_dir
from shared.errors import InvalidRequestError


def default_profile_path(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "profile.json"


def add_parsers(sub: Any) -> None:
    prof = sub.add_parser("profile", help="measure the engine on this machine for `baton plan`")
    prof.add_argument("--out", type=Path, default=None, help="default: <cache>/profile.json")
    prof.add_argument(
        "--threads", type=int, nargs="+", default=None, help="thread counts (default: 1..CPUs)"
    )
    prof.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded)")
    prof.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default=None,
        help=f"compute dtype to profile ({from_settings('dtype')})",
    )
    prof.add_argument(
        "--transport",
        choices=["tcp", "ucx"],
        default=settings_default("transport"),  # what `baton up` runs: its store CPU is metered
        help="KV data plane",
    )
    prof.add_argument("--quick", action="store_true", help="fewer points (about a minute)")
    prof.add_argument(
        "--engine-only",
        action="store_true",
        help="skip measuring what serving adds to the engine's times (a 1P:1D cluster)",
    )
    plan = sub.add_parser(
        "plan", help="simulate a workload on candidate deployments and rank them by goodput"
    )
    plan.add_argument("--workload", type=Path, required=True, help="Azure CSV or prefix-hash JSONL")
    plan.add_argument("--slo-ttft", type=float, required=True, help="seconds")
    plan.add_argument("--slo-tpot", type=float, required=True, help="seconds")
    plan.add_argument("--cores", type=int, required=True, help="cores for the whole deployment")
    plan.add_argument("--profile", type=Path, default=None, help="default: <cache>/profile.json")
    plan.add_argument("--num-requests", type=int, default=None, help="the first N (default: all)")
    plan.add_argument("--time-scale", type=float, default=1.0, help="as `baton bench`'s")
    plan.add_argument("--token-scale", type=float, default=1.0, help="as `baton bench`'s")
    plan.add_argument("--max-input", type=int, default=4096, help="prompts cut to this")
    plan.add_argument("--max-output", type=int, default=512, help="outputs cut to this")
    plan.add_argument(
        "--trace-block-size", type=int, default=512, help="tokens per hash of prefix-hash traces"
    )
    plan.add_argument(
        "--threads", type=int, nargs="+", default=None, help="per instance (default: 1..CPUs)"
    )
    plan.add_argument(
        "--max-seqs", type=int, nargs="+", default=[16, 64], help="decode batch limits"
    )
    plan.add_argument(
        "--oversubscribe",
        type=float,
        default=1.0,
        help="also consider splits with up to this many threads per core (1: none share)",
    )
    plan.add_argument(
        "--client-on-host",
        action="store_true",
        help="the clients share the deployment's cores (a benchmark on the serving machine): "
        "charge their CPU too (default: clients elsewhere)",
    )
    plan.add_argument("--top", type=int, default=0, help="print only the best N (0: all)")
    plan.add_argument("--json", action="store_true", help="the ranking as JSON")


def run_profile(args: argparse.Namespace) -> int:
    from shared.capacity.measure import measure
    from shared.engine.engine import Engine

    overrides: dict[str, object] = {"prefault_kv": False, "kv_cache_gb": 1.0}
    if args.model:
        overrides["model"] = args.model
    if args.dtype:
        overrides["dtype"] = args.dtype
    settings = BatonSettings(**overrides)  # type: ignore[arg-type]
    threads = args.threads or list(range(1, len(os.sched_getaffinity(0)) + 1))
    if any(t < 1 for t in threads):
        raise InvalidRequestError("--threads must be at least 1")
    engine = Engine.from_config(settings.engine_config(), cache_dir=settings.cache_dir)

    def say(line: str) -> None:
        print(f"baton profile: {line}", file=sys.stderr, flush=True)

    quick = {
        "prefill_tokens": (128, 512, 2048),
        "decode_batches": (1, 8, 32),
        "decode_contexts": (256, 1024),
        "repeats": 1,
        "transfer_mb": 16,
    }
    profile = measure(
        engine,
        threads=threads,
        transport=args.transport,
        progress=say,
        **(quick if args.quick else {}),  # type: ignore[arg-type]
    )
    if not args.engine_only:
        from shared.capacity.overhead import QUICK, Points, measure_overhead

        overhead = measure_overhead(
            profile,
            model=args.model,
            dtype=args.dtype,
            points=QUICK if args.quick else Points(),
            progress=say,
        )
        profile = replace(profile, overhead=overhead)
        say(
            f"serving adds {overhead.request_s * 1e3:.0f} ms per prompt and "
            f"{overhead.step_s * 1e3:.1f} + {overhead.token_s * 1e3:.2f} ms/stream per decode step"
        )
        for name, side in (
            ("gateway, store and Redis", overhead.cluster),
            ("workers beside their engine threads", overhead.workers),
            ("client", overhead.client),
        ):
            say(
                f"{name} use {side.request_s * 1e3:.1f} ms CPU per request, "
                f"{side.prompt_token_s * 1e6:.1f} us per prompt token, "
                f"{side.output_token_s * 1e6:.0f} us per output token"
            )
    out = args.out or default_profile_path(settings.cache_dir)
    profile.save(out)
    print(f"baton profile: {len(profile.prefill)} prefill and {len(profile.decode)} decode points")
    print(f"baton profile: transfer {profile.transfer_bytes_s / 1e9:.2f} GB/s; saved {out}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from shared.capacity import plan as planner
    from shared.capacity.profile import load

    if args.cores < 1 or args.slo_ttft <= 0 or args.slo_tpot <= 0:
        raise InvalidRequestError("--cores must be >= 1 and the SLOs > 0")
    if args.oversubscribe < 1:
        raise InvalidRequestError("--oversubscribe must be at least 1")
    profile = load(args.profile or default_profile_path(BatonSettings().cache_dir))
    requests = planner.load_workload(
        args.workload,
        n=args.num_requests,
        time_scale=args.time_scale,
        token_scale=args.token_scale,
        max_input=args.max_input,
        max_output=args.max_output,
        block_tokens=args.trace_block_size,
    )
    threads = args.threads or profile.threads
    deployments = planner.candidates(
        args.cores, threads, args.max_seqs, oversubscribe=args.oversubscribe, slo_tpot=args.slo_tpot
    )
    if not deployments:
        raise InvalidRequestError(f"no deployment fits {args.cores} core(s) with {threads}")
    ranked = planner.evaluate(
        requests,
        deployments,
        profile,
        args.cores,
        args.slo_ttft,
        args.slo_tpot,
        client_on_host=args.client_on_host,
    )
    shown = ranked[: args.top] if args.top else ranked
    if args.json:
        print(json.dumps([asdict(c) for c in shown], indent=1))
    else:
        print(f"{len(requests)} requests of {args.workload}, {args.cores} core(s)")
        print(planner.table(shown, args.slo_ttft, args.slo_tpot), end="")
        best = ranked[0]
        print(f"recommended: {best.deployment.describe()}: {best.goodput:.3f} req/s predicted")
        from shared.model.registry import DEFAULT_MODEL, MODELS

        # a named model the profile measured (a file or folder's path is not in the profile)
        named = profile.model if profile.model in MODELS else None
        model = None if named == DEFAULT_MODEL.name else named
        up = planner.up_command(best.deployment, args.slo_ttft, args.slo_tpot, model)
        print(f"run it: {up}")
    return 0
