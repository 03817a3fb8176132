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
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.bench_cluster import bench_cluster
from benchmarks.results import save_json
from shared.bench import structured, tools
from shared.bench.metrics import RequestResult
from shared.bench.runner import Target, discover_model, run_open_loop
from shared.bench.structured import Validity
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
    return {
        "first_compile_with_tokenizer_s": tokenizer_s,
        "cold_s": cold,
        "cached_s": cached,
        "replay_s": replay_times(compiler, tok),
    }


def replay_times(compiler: GrammarCompiler, tok: Any) -> dict[int, float]:
    """What a decode instance or a failover resume pays to rebuild a request's grammar
    state (llguidance has no serialized state: the matcher is made from the cached
    template and the tokens so far replayed), by tokens so far: a JSON object's output
    of about that many tokens, median of 5."""
    constraint = Constraint.json_object()
    compiler.compile(constraint)
    out: dict[int, float] = {}
    for n in (16, 64, 256, 1024):
        items = ",".join(f'"k{i}":{i}' for i in range(n))
        ids = tok.encode("{" + items + "}")
        while len(ids) > n:  # drop whole items until it fits, keep it a valid prefix
            items = items.rsplit(",", 1)[0]
            ids = tok.encode("{" + items + "}")
        ids = ids[:-1]  # the closing brace not yet written
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            compiler.matcher(constraint).replay(ids)
            runs.append(time.perf_counter() - t0)
        out[len(ids)] = statistics.median(runs)
    return out


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


Twin = Callable[[RequestSpec, RequestResult], RequestSpec]
Check = Callable[[Sequence[RequestSpec], Sequence[RequestResult]], Validity]


async def pair(
    target: Target, specs: list[RequestSpec], twin: Twin, check: Check, in_flight: int
) -> dict[str, Any]:
    """Constrained requests and their unconstrained twins in alternating blocks of
    ``2 * in_flight``, so drift in the host's speed falls on both alike."""
    constrained: list[RequestResult] = []
    free: list[RequestResult] = []
    took = free_took = 0.0
    block = 2 * in_flight
    for start in range(0, len(specs), block):
        chunk = specs[start : start + block]
        got, seconds = await run_open_loop(target, chunk, lambda: None, in_flight)
        constrained += got
        took += seconds
        twins = [twin(s, r) for s, r in zip(chunk, got, strict=True) if r.ok]
        got, seconds = await run_open_loop(target, twins, lambda: None, in_flight)
        free += got
        free_took += seconds
    c, u = tpots(constrained), tpots(free)
    return {
        "in_flight": in_flight,
        "requests": len(specs),
        "validity": check(specs, constrained).as_dict(),
        "constrained": side(constrained, took),
        "unconstrained": side(free, free_took),
        "tpot_ratio_median": statistics.median(c) / statistics.median(u),
        "tpot_ratio_mean": statistics.mean(c) / statistics.mean(u),
    }


def schema_workload(args: argparse.Namespace, seed: int) -> tuple[list[RequestSpec], Twin]:
    n = args.requests
    specs = structured.structured(n, args.input_len, args.output_len, [0.0] * n, seed)
    # fresh prompts of the same length, so the twin is not served from the prefix cache
    fresh = iter(structured.structured(n, args.input_len, 1, [0.0] * n, seed + 1))
    prompts = {id(s): next(fresh).prompt for s in specs}

    def twin(spec: RequestSpec, result: RequestResult) -> RequestSpec:
        return RequestSpec(prompts[id(spec)], max(result.output_tokens, 1), 0.0, seed=spec.seed)

    return specs, twin


def tool_workload(args: argparse.Namespace, seed: int) -> tuple[list[RequestSpec], Twin]:
    n = args.tool_requests
    specs = tools.tool_requests(n, args.output_len, [0.0] * n, seed)

    def twin(spec: RequestSpec, result: RequestResult) -> RequestSpec:
        # the same tools offered with tool_choice auto (a free output, parsed after), the
        # same output length; a new user message, so the prompt is not a cache hit whole
        chat = dict(spec.chat or {})
        message = dict(chat["messages"][0])
        message["content"] = "Again. " + message["content"]
        chat |= {"messages": [message], "tool_choice": "auto", "ignore_eos": True}
        return replace(spec, max_tokens=max(result.output_tokens, 1), chat=chat, label=None)

    return specs, twin


def report(what: str, row: dict[str, Any]) -> None:
    v = row["validity"]
    print(
        f"{what:>10} {row['in_flight']:2d} in flight: {v['valid']}/{v['requests']} valid "
        f"({v['cut_by_max_tokens']} cut, invalid {v['invalid']}); TPOT median "
        f"{row['constrained']['tpot_median_s'] * 1e3:.2f} ms constrained vs "
        f"{row['unconstrained']['tpot_median_s'] * 1e3:.2f} ms free: "
        f"{row['tpot_ratio_median']:.3f}x (mean {row['tpot_ratio_mean']:.3f}x); TTFT "
        f"median {row['constrained']['ttft_median_s'] * 1e3:.1f} vs "
        f"{row['unconstrained']['ttft_median_s'] * 1e3:.1f} ms",
        flush=True,
    )


async def json_objects(target: Target, n: int, max_tokens: int, seed: int) -> dict[str, Any]:
    """``response_format: json_object`` on chat prompts that ask for JSON; each answer
    must parse as one JSON object."""
    rng = random.Random(seed)
    things = ["a book", "a city", "a recipe", "a planet", "a laptop", "a movie", "a bird"]
    specs = [
        RequestSpec(
            (), max_tokens, 0.0, seed=rng.randrange(1 << 30) if i % 2 else None,
            chat={
                "messages": [{"role": "user", "content":
                              f"Request {i}: describe {rng.choice(things)} as a JSON object."}],
                "response_format": {"type": "json_object"},
            },
        )
        for i in range(n)
    ]  # fmt: skip
    results, _ = await run_open_loop(target, specs, lambda: None, 8)
    parsed = cut = 0
    bad: list[str] = []
    for r in results:
        try:
            if isinstance(json.loads(r.text or ""), dict):
                parsed += 1
                continue
        except ValueError:
            pass
        if r.finish_reason == "length":
            cut += 1
        else:
            bad.append((r.text or r.error or "")[:120])
    return {"requests": n, "parsed": parsed, "cut_by_max_tokens": cut, "unparsed": bad}


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        model = await discover_model(http, url)
    target = Target(url, model)
    warm = structured.structured(len(structured.SCHEMAS), 32, 64, [0.0] * 11, args.seed + 7)
    await run_open_loop(target, warm, lambda: None, 4)
    await run_open_loop(target, [replace(w, structured=None) for w in warm], lambda: None, 4)
    out: dict[str, Any] = {"schemas": [], "tools": []}
    for k, in_flight in enumerate(args.in_flight):
        seed = args.seed + 1000 * k  # fresh prompts each run: no prefix cache
        specs, twin = schema_workload(args, seed)
        row = await pair(target, specs, twin, structured.check, in_flight)
        out["schemas"].append(row)
        report("schemas", row)
        if args.tool_requests:
            specs, twin = tool_workload(args, seed)
            row = await pair(target, specs, twin, tools.check, in_flight)
            out["tools"].append(row)
            report("tools", row)
    if args.json_objects:
        out["json_object"] = got = await json_objects(
            target, args.json_objects, args.json_object_max_tokens, args.seed
        )
        print(
            f"json_object: {got['parsed']}/{got['requests']} parse, "
            f"{got['cut_by_max_tokens']} cut by max_tokens, unparsed {got['unparsed']}",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start a cluster)")
    ap.add_argument("--model", default=None, help="for the compile times (default: embedded)")
    ap.add_argument("--requests", type=int, default=110, help="schema requests per concurrency")
    ap.add_argument("--tool-requests", type=int, default=48, help="per concurrency (0: none)")
    ap.add_argument("--json-objects", type=int, default=40, help="json_object requests")
    ap.add_argument("--json-object-max-tokens", type=int, default=512)
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
        f"median {statistics.median(compiled['cached_s'].values()) * 1e6:.0f} us; replay "
        + ", ".join(f"{n} tokens {t * 1e3:.2f} ms" for n, t in compiled["replay_s"].items()),
        flush=True,
    )
    with ExitStack() as stack:
        url = args.url
        if url is None:
            local = stack.enter_context(
                bench_cluster(args.logs, "structured", {}, dtype=args.dtype)
            )
            url = local.gateway_url
        runs = asyncio.run(measure(url, args))
    save_json(args.out, {"compile": compiled, **runs, "args": vars(args) | {"out": None}})


if __name__ == "__main__":
    main()
