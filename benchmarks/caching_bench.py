"""Context caching measured on the real cluster (2 prefill + 2 decode + a KV store node
+ the gateway, 1 torch thread per worker), caching on next to caching off
(``BATON_ENABLE_PREFIX_CACHING=false``, what ``baton up --no-prefix-cache`` sets).
Rounds alternate on/off so the noisy VM hits both alike; ratios are per round.

- ``multi-turn``: conversations of ``--turns`` turns (first prompt
  ``--history`` tokens, each later turn adds the answer and ``--user-len`` new
  tokens, after an exponential think time); TTFT by turn, on over off.
- ``no-reuse``: unique prompts only, so caching can only cost: TTFT and TPOT at
  a paced rate, and output throughput with ``--burst`` prompts at once (the
  capacity), on over off, per round and pooled over rounds.
- ``trace``: a synthetic prefix-hash trace (shared system prompts, growing
  sessions; :mod:`shared.bench.prefix_trace`), store larger than its working
  set: reused tokens against the infinite-cache oracle, the router's predicted
  cached tokens against those actually reused, and how evenly the prefill
  instances shared the work (tokens each computed, max over mean); ``--gateways N``
  routes it through N gateways behind the balancer (round robin).
- ``crossover``: pull or recompute a cached prefix of P tokens: the prefill
  compute time of P cached + 16 new tokens on a prefill instance that holds
  nothing locally, with ``BATON_PREFILL_PULL_POLICY=always`` and ``never``.

    python -m benchmarks.caching_bench multi-turn --rounds 2
    python -m benchmarks.caching_bench no-reuse --rounds 2
    python -m benchmarks.caching_bench trace [--gateways 2]
    python -m benchmarks.caching_bench crossover
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_cluster import bench_cluster
from benchmarks.results import save_json
from shared.bench import prefix_trace
from shared.bench import workload as wl
from shared.bench.metrics import RequestResult, summarize
from shared.bench.report import RunReport, text_summary
from shared.bench.runner import Target, run_conversations, run_open_loop
from shared.bench.scrape import metric_sum
from shared.launcher import LocalCluster

MODEL = "SmolLM2-135M-Instruct"


def cluster(
    args: argparse.Namespace,
    caching: bool,
    *,
    prefill: int = 2,
    decode: int = 2,
    kvstore_gb: float = 2.0,
    gateways: int = 1,
    **env: str,
) -> AbstractContextManager[LocalCluster]:
    """The cluster; ``args.logs`` keeps its services' logs (info level) there."""
    return bench_cluster(
        args.logs, "caching", env, prefill=prefill, decode=decode, kv_cache_gb=1.0,
        kvstore_gb=kvstore_gb, prefix_caching=caching, gateways=gateways,
    )  # fmt: skip


def cpu_seconds(local: LocalCluster) -> dict[str, float]:
    """CPU time (user + system) each role's processes have used so far, Redis included."""
    import psutil

    out: dict[str, float] = {}
    procs = [(s.role, local.procs[s.name].proc) for s in local.specs]
    procs.append(("redis", local.redis.proc))
    for role, proc in procs:
        if proc is None:
            continue
        t = psutil.Process(proc.pid).cpu_times()
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def urls(local: LocalCluster, role: str) -> list[str]:
    return [f"http://127.0.0.1:{s.http_port}" for s in local.specs if s.role == role]


def run(
    local: LocalCluster, fn: Callable[..., Any], *args: Any
) -> tuple[list[RequestResult], float]:
    target = Target(local.gateway_url, MODEL)
    return asyncio.run(fn(target, *args))


def on_off_rounds(rounds: int) -> list[bool]:
    return [caching for _ in range(rounds) for caching in (True, False)]


# -- multi-turn ------------------------------------------------------------------------------
def multi_turn(args: argparse.Namespace) -> dict[str, Any]:
    n = args.conversations
    times = [i * args.stagger for i in range(n)]
    specs = wl.multi_turn(
        n, args.turns, args.history, args.user_len, args.output_len, times, args.seed,
        think_s=args.think,
    )  # fmt: skip
    rounds: list[dict[str, Any]] = []
    for caching in on_off_rounds(args.rounds):
        with cluster(args, caching) as local:
            results, duration = run(local, run_conversations, specs, lambda: None, args.seed)
        summary = summarize(results, duration)
        print(
            text_summary(
                RunReport(
                    f"multi-turn caching={'on' if caching else 'off'}", None, summary, results
                )
            )
        )
        by_turn = {
            t: [r.ttft for r in results if r.turn == t and r.ttft is not None]
            for t in range(args.turns)
        }
        rounds.append(
            {
                "caching": caching,
                "ttft_by_turn": {t: _stats(v) for t, v in by_turn.items()},
                "late_turns_ttft": _stats([x for t, v in by_turn.items() if t >= 2 for x in v]),
                "hit_rate": summary.cache.hit_rate if summary.cache else None,
                "failed": summary.failed,
            }
        )
    ratios = [
        on["late_turns_ttft"]["mean"] / off["late_turns_ttft"]["mean"]
        for on, off in zip(rounds[::2], rounds[1::2], strict=True)
    ]
    medians = [
        on["late_turns_ttft"]["median"] / off["late_turns_ttft"]["median"]
        for on, off in zip(rounds[::2], rounds[1::2], strict=True)
    ]
    print(f"TTFT at turns >= 3, caching on / off: mean {_fmt(ratios)}, median {_fmt(medians)}")
    return {
        "rounds": rounds,
        "late_turn_ttft_ratio_mean": ratios,
        "late_turn_ttft_ratio_median": medians,
    }


# -- no reuse ----------------------------------------------------------------------------------
def no_reuse(args: argparse.Namespace) -> dict[str, Any]:
    """Per round: one request at a time (``--num-prompts``; TTFT, TPOT without
    queueing noise) and a saturated phase (``--burst`` prompts at once; output
    throughput = capacity). Rounds alternate which of on/off goes first."""
    rounds: list[dict[str, Any]] = []
    order = [c if k % 2 == 0 else not c for k in range(args.rounds) for c in (True, False)]
    for k, caching in enumerate(order):
        # unique prompts in every round: nothing is reusable, on or off
        seed = args.seed + k // 2 * 1000 + 7
        one_by_one = wl.synthetic(
            args.num_prompts, args.input_len, args.output_len, [0.0] * args.num_prompts, seed
        )
        burst = wl.synthetic(
            args.burst, args.input_len, args.output_len, [0.0] * args.burst, seed + 500
        )
        label = f"caching={'on' if caching else 'off'}"
        with cluster(args, caching) as local:
            results, duration = run(local, run_open_loop, one_by_one, lambda: None, 1)
            s = summarize(results, duration)
            print(text_summary(RunReport(f"no-reuse one at a time {label}", None, s, results)))
            cpu_before = cpu_seconds(local)
            results, duration = run(local, run_open_loop, burst, lambda: None, None)
            cpu = {k: v - cpu_before[k] for k, v in cpu_seconds(local).items()}
            b = summarize(results, duration)
            print("burst CPU seconds by role:", {k: round(v, 2) for k, v in cpu.items()})
            print(text_summary(RunReport(f"no-reuse burst {label}", None, b, results)))
        rounds.append(
            {
                "caching": caching,
                "ttft_mean": s.ttft.mean,
                "ttft_median": s.ttft.median,
                "tpot_median": s.tpot.median,
                "burst_output_throughput": b.output_throughput,
                "burst_cpu_s": cpu,
                "failed": s.failed + b.failed,
            }
        )
    pairs = [
        (a, b) if a["caching"] else (b, a) for a, b in zip(rounds[::2], rounds[1::2], strict=True)
    ]
    ttft_mean = [a["ttft_mean"] / b["ttft_mean"] for a, b in pairs]
    ttft_median = [a["ttft_median"] / b["ttft_median"] for a, b in pairs]
    tpot = [a["tpot_median"] / b["tpot_median"] for a, b in pairs]
    throughput = [a["burst_output_throughput"] / b["burst_output_throughput"] for a, b in pairs]
    on = [r for r in rounds if r["caching"]]
    off = [r for r in rounds if not r["caching"]]

    def pooled(key: str) -> float:
        return statistics.mean(r[key] for r in on) / statistics.mean(r[key] for r in off)

    print(
        f"no reuse, caching on / off per round: TTFT mean {_fmt(ttft_mean)}, median "
        f"{_fmt(ttft_median)}; TPOT median {_fmt(tpot)}; saturated throughput {_fmt(throughput)}"
    )
    print(
        f"all rounds pooled: TTFT mean {pooled('ttft_mean'):.3f}, TPOT median "
        f"{pooled('tpot_median'):.3f}, throughput {pooled('burst_output_throughput'):.3f}"
    )
    return {
        "rounds": rounds,
        "ttft_mean_ratio": ttft_mean,
        "ttft_median_ratio": ttft_median,
        "tpot_median_ratio": tpot,
        "throughput_ratio": throughput,
        "pooled": {
            "ttft_mean": pooled("ttft_mean"),
            "ttft_median": pooled("ttft_median"),
            "tpot_median": pooled("tpot_median"),
            "throughput": pooled("burst_output_throughput"),
        },
    }


# -- trace replay -------------------------------------------------------------------------------
def trace(args: argparse.Namespace) -> dict[str, Any]:
    rows = prefix_trace.synthesize(
        args.num_prompts, block_tokens=args.trace_block, rate=args.rate, seed=args.seed
    )
    specs = prefix_trace.replay(
        rows,
        n=args.num_prompts,
        block_tokens=args.trace_block,
        max_input=args.max_input,
        max_output=args.output_len,
    )
    working_set = len({r.hash_ids[: k + 1] for r in rows for k in range(len(r.hash_ids))})
    with cluster(args, True, kvstore_gb=args.store_gb, gateways=args.gateways) as local:
        before = prediction_counts(local)
        results, duration = run(local, run_open_loop, specs, lambda: None, None)
        after = prediction_counts(local)
        work = [metric_sum(u, "baton_engine_step_tokens_total") for u in urls(local, "prefill")]
        evictions = sum(
            metric_sum(u, "baton_kvstore_evictions_total") for u in urls(local, "kvstore")
        )
    s = summarize(results, duration)
    print(text_summary(RunReport("prefix trace", args.rate, s, results)))
    predictions = {o: after[o] - before[o] for o in after}
    total = sum(predictions.values()) or 1.0
    out = {
        "requests": len(specs),
        "gateways": args.gateways,
        "working_set_blocks": working_set,
        "store_evictions": evictions,
        "hit_rate": s.cache.hit_rate if s.cache else None,
        "oracle_hit_rate": s.cache.oracle_hit_rate if s.cache else None,
        "of_oracle": s.cache.of_oracle if s.cache else None,
        "predictions": predictions,
        "prediction_exact_share": predictions["exact"] / total,
        "prefill_tokens_computed": work,
        "prefill_work_max_over_mean": max(work) / statistics.mean(work)
        if work and statistics.mean(work)
        else None,
        "failed": s.failed,
        "ttft_median": s.ttft.median,
    }
    print(json.dumps({k: v for k, v in out.items()}, indent=1))
    return out


def prediction_counts(local: LocalCluster) -> dict[str, float]:
    """The router's cached-token predictions so far by outcome, over every gateway."""
    return {
        o: sum(
            metric_sum(u, "baton_router_predictions_total", f'outcome="{o}"')
            for u in urls(local, "gateway")
        )
        for o in ("exact", "over", "under")
    }


# -- pull or recompute ----------------------------------------------------------------------------
def crossover(args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.prefixes.split(",")]
    out: dict[str, Any] = {"prefix_tokens": lengths, "new_tokens": 16}
    for policy in ("always", "never"):
        with cluster(args, True, decode=1, BATON_PREFILL_PULL_POLICY=policy) as local:
            warm_url, cold_url = urls(local, "prefill")
            times: dict[int, list[float]] = {p: [] for p in lengths}
            for rep in range(args.repeats):
                for p in lengths:
                    rng = random.Random(f"{args.seed}:{rep}:{p}")
                    prefix = [rng.randrange(1000, 30000) for _ in range(p)]
                    prompt = prefix + [rng.randrange(1000, 30000) for _ in range(16)]
                    auth = local.secret.headers()
                    _prefill(warm_url, f"warm-{rep}-{p}", [*prefix, 7], auth)
                    cold = _prefill(cold_url, f"cold-{rep}-{p}-{policy}", prompt, auth)
                    times[p].append(cold)
        out[policy] = {p: statistics.median(v) for p, v in times.items()}
        print(policy, {p: f"{v * 1e3:.1f} ms" for p, v in out[policy].items()})
    winners = [p for p in lengths if out["always"][p] < out["never"][p]]
    out["crossover_tokens"] = min(winners) if winners else None
    print(f"pulling beats recomputing from {out['crossover_tokens']} cached tokens on")
    return out


def _prefill(url: str, rid: str, prompt: list[int], headers: dict[str, str]) -> float:
    """Prefill compute time (first layer to first token) as the instance reports it."""
    body = {
        "request_id": rid,
        "prompt_token_ids": prompt,
        "sampling": {"max_tokens": 1, "temperature": 0.0, "top_p": 1.0, "seed": 1},
    }
    compute = None
    with httpx.stream("POST", url + "/v1/prefill", json=body, headers=headers, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            event = json.loads(line)
            if event["event"] == "first_token":
                compute = float(event["queue_s"]) + float(event["compute_s"])
    if compute is None:
        raise RuntimeError(f"prefill {rid} gave no first token")
    return compute


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0, "mean": float("nan"), "median": float("nan")}
    return {
        "count": len(values),
        "mean": statistics.mean(values),
        "median": statistics.median(values),
    }


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("experiment", choices=["multi-turn", "no-reuse", "trace", "crossover"])
    ap.add_argument("--rounds", type=int, default=1, help="on/off pairs, alternated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--history", type=int, default=1000, help="first prompt's tokens")
    ap.add_argument("--user-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--think", type=float, default=2.0, help="mean think time (s)")
    ap.add_argument("--stagger", type=float, default=1.5, help="conversation start gap (s)")
    ap.add_argument("--num-prompts", type=int, default=30)
    ap.add_argument("--burst", type=int, default=24, help="no-reuse: prompts sent at once")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--rate", type=float, default=0.5, help="requests/s (no-reuse, trace)")
    ap.add_argument("--trace-block", type=int, default=64)
    ap.add_argument("--max-input", type=int, default=2048)
    ap.add_argument("--store-gb", type=float, default=2.0)
    ap.add_argument("--gateways", type=int, default=1, help="trace: gateways behind the balancer")
    ap.add_argument("--prefixes", default="16,32,64,128,256,512,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--logs", type=Path, default=None, help="keep service logs here")
    args = ap.parse_args()
    run_experiment = {
        "multi-turn": multi_turn,
        "no-reuse": no_reuse,
        "trace": trace,
        "crossover": crossover,
    }[args.experiment]
    result = run_experiment(args)
    out = args.out or Path(f"bench-results/caching-{args.experiment}.json")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    save_json(out, {"args": config | {"out": str(out)}, "result": result})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
