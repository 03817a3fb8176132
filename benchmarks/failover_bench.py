"""Failover measured on the real cluster (2 prefill + 3 decode + KV store + Redis + the
gateway, 1 torch thread per worker, a supervisor restarting what dies as ``baton up``
does). Every stream is checked against the failure-free tokens computed in this
process (greedy and seeded): a broken stream is an error or any token that differs.

- ``chaos``: ``--rounds`` faults (``--fault kill|stop|term``) of the busiest decode
  instance, each while ``--streams`` streams run; broken streams, and the client's
  resume gap: fault to the next token of each stream in flight (the worst stream of
  a round is the one that failed over), with the gateway's own resume-gap figure.
- ``e2e``: one 512-in/256-out request, failure-free and with its decode instance
  killed half-way, alternating; E2E killed over failure-free.
- ``replication``: decode replication on and off (``BATON_DECODE_REPLICATE``), with
  caching off in both (so off writes nothing decode computes), a fresh cluster per
  run, on/off order alternating by round; TPOT on over off under steady load.
- ``rolling``: every prefill and decode instance drained (SIGTERM) and restarted in
  turn under steady load; broken streams.
- ``store``: 2 store nodes, every block on both; one killed under load; failed requests.
- ``redis``: Redis killed for ``--down`` seconds under load, then started again
  empty; failed requests, and seconds until membership, the prompt index and
  watermarks are back; then one SIGKILL of a decode instance (failover works again).

    python -m benchmarks.failover_bench chaos --fault kill --rounds 20
    python -m benchmarks.failover_bench e2e --rounds 3
    python -m benchmarks.failover_bench replication --rounds 3
    python -m benchmarks.failover_bench rolling
    python -m benchmarks.failover_bench soak --duration 600 --streams 16

- ``soak``: no fault, ``--duration`` seconds of saturating load with ``--prompt``-token
  prompts; any failover is a false alarm (the hang detection's false-positive rate).
- ``gateway``: 2 gateways behind the balancer (HAProxy), 2 decode instances;
  ``--rounds`` faults (``--fault kill|term``) of the gateway producing most of
  ``--streams`` resumable streams, part way; each client (the reference client,
  :mod:`shared.bench.resume_client`) reconnects through the balancer with
  ``Last-Event-ID``. Broken streams, and the resume gap of every stream that lost its
  connection (noticing the break to the next event); the supervisor restarts the
  gateway between rounds, so the rounds roll over both. ``--api responses``: the
  same with background Responses API streams read by the official SDK, resumed with
  ``responses.stream(response_id=..., starting_after=N)`` (:mod:`benchmarks.responses_client`),
  each text checked against the in-process engine's on the prompt the gateway templates.

    python -m benchmarks.failover_bench gateway --fault kill --rounds 20 --streams 4
    python -m benchmarks.failover_bench gateway --api responses --rounds 20 --streams 4

- ``gateway-rolling``: both gateways drained (SIGTERM) and restarted in turn,
  ``--gateway-rounds`` times, under a steady load of ``--streams`` resumable streams
  through the balancer; broken streams, and the gaps of those that reconnected.

    python -m benchmarks.failover_bench gateway-rolling --gateway-rounds 3 --streams 4
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

from benchmarks.bench_cluster import bench_cluster
from benchmarks.responses_client import ResponsesCase, ResumedResponse, read_response
from benchmarks.results import save_json
from services.prefill.prefiller import PREFILL_CHUNK_TOKENS
from shared.bench import chaos
from shared.bench.chaos import ChaosRequest, StreamResult
from shared.bench.resume_client import ResumedStream, read_resumable
from shared.bench.scrape import metric_sum
from shared.config import BatonSettings, CacheConfig, EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.launcher import LocalCluster
from shared.model.loader import load_model

MODEL = "SmolLM2-135M-Instruct"


@contextmanager
def cluster(
    args: argparse.Namespace,
    *,
    kvstore: int = 1,
    replication: int = 1,
    prefill: int = 2,
    gateways: int = 1,
    **env: str,
) -> Iterator[chaos.Supervised]:
    """The cluster, with a supervisor restarting what dies (as ``baton up`` does)."""
    with bench_cluster(
        args.logs, "failover", env, prefill=prefill, decode=args.decode, kvstore=kvstore,
        replication=replication, kv_cache_gb=0.5, kvstore_gb=1.0, gateways=gateways,
    ) as local:  # fmt: skip
        supervised = chaos.Supervised(local, say=print)
        try:
            yield supervised
        finally:
            supervised.close()


class Reference:
    """The failure-free tokens, computed in this process by the same engine."""

    def __init__(self) -> None:
        loaded = load_model(
            None, cache_dir=BatonSettings().cache_dir, dtype="float32", progress=False
        )
        config = EngineConfig(
            cache=CacheConfig(kv_cache_bytes=256 << 20, enable_prefix_caching=False),
            scheduler=SchedulerConfig(long_prefill_token_threshold=PREFILL_CHUNK_TOKENS),
        )
        self.engine = Engine(loaded, config)

    def broken(self, results: list[StreamResult] | list[ResumedStream]) -> list[str]:
        reqs = [r.request for r in results]
        return chaos.broken(results, chaos.reference(self.engine, reqs))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def gateway_resume_gap(url: str) -> dict[str, float]:
    total = metric_sum(url, "baton_resume_gap_seconds_sum")
    count = metric_sum(url, "baton_resume_gap_seconds_count")
    return {"count": count, "mean_s": total / count if count else float("nan")}


# -- chaos -----------------------------------------------------------------------------------
def run_chaos(args: argparse.Namespace, ref: Reference) -> dict[str, Any]:
    rng = random.Random(args.seed)
    rounds: list[dict[str, Any]] = []
    with cluster(args) as sup:
        local = sup.local
        for i in range(args.rounds):
            chaos.settle(local)
            reqs = chaos.make_requests(
                rng, args.streams, prompt_len=(100, 300), max_tokens=args.output_len
            )
            run = asyncio.run(chaos.with_fault(local, MODEL, reqs, args.fault))
            gaps = run.gaps()
            bad = ref.broken(run.results)
            rounds.append(
                {"victim": run.victim, "broken": bad, "gaps_s": gaps, "worst_gap_s": max(gaps)}
            )
            print(f"round {i + 1}: {run.victim} {args.fault}: broken {len(bad)}, "
                  f"worst gap {max(gaps):.3f}s", flush=True)  # fmt: skip
        failovers = chaos.failovers(local.gateway_url, args.fault)
        gateway_gap = gateway_resume_gap(local.gateway_url)
    worst = [r["worst_gap_s"] for r in rounds]
    every = [g for r in rounds for g in r["gaps_s"]]
    return {
        "fault": args.fault,
        "rounds": len(rounds),
        "streams": len(rounds) * args.streams,
        "broken_streams": sum(len(r["broken"]) for r in rounds),
        "failovers": failovers,
        "resume_gap_worst_stream_s": {"p50": pct(worst, 0.5), "p99": pct(worst, 0.99),
                                      "max": max(worst)},
        "gap_every_stream_s": {"p50": pct(every, 0.5), "p99": pct(every, 0.99)},
        "gateway_resume_gap": gateway_gap,
        "per_round": rounds,
    }  # fmt: skip


# -- e2e of a killed request -----------------------------------------------------------------
def run_e2e(args: argparse.Namespace, ref: Reference) -> dict[str, Any]:
    rng = random.Random(args.seed)
    clean: list[float] = []
    killed: list[float] = []
    bad: list[str] = []
    with cluster(args) as sup:
        local = sup.local
        for _ in range(args.rounds):
            for kill in (False, True):
                chaos.settle(local)
                req = chaos.make_requests(rng, 1, prompt_len=(512, 512), max_tokens=256)
                if kill:
                    run = asyncio.run(chaos.with_fault(local, MODEL, req, "kill", after_tokens=128))
                    result = run.results[0]
                else:
                    result = asyncio.run(single(local, req[0]))
                bad += ref.broken([result])
                (killed if kill else clean).append(result.ended - result.started)
    ratio = statistics.median(killed) / statistics.median(clean)
    print(f"E2E 512-in/256-out: failure-free {statistics.median(clean):.3f}s, "
          f"killed {statistics.median(killed):.3f}s, ratio {ratio:.3f}", flush=True)  # fmt: skip
    return {"clean_s": clean, "killed_s": killed, "ratio_median": ratio, "broken": bad}


async def single(local: LocalCluster, req: ChaosRequest) -> StreamResult:
    async with httpx.AsyncClient(timeout=600) as http:
        return await chaos.stream(http, local.gateway_url, MODEL, req)


# -- replication on / off --------------------------------------------------------------------
def tpot(results: list[StreamResult]) -> float:
    """Mean time per output token after the first, over streams."""
    per = [(r.stamps[-1] - r.stamps[0]) / (len(r.stamps) - 1) for r in results if len(r.stamps) > 1]
    return statistics.mean(per)


def run_replication(args: argparse.Namespace, ref: Reference) -> dict[str, Any]:
    rounds = []
    for i in range(args.rounds):
        row: dict[str, float] = {}
        for on in (True, False) if i % 2 == 0 else (False, True):
            rng = random.Random(args.seed + i)
            reqs = iter(chaos.make_requests(rng, 1000, prompt_len=(100, 300),
                                            max_tokens=args.output_len))  # fmt: skip
            with cluster(
                args, BATON_DECODE_REPLICATE=str(on).lower(), BATON_ENABLE_PREFIX_CACHING="false"
            ) as sup:
                local = sup.local
                chaos.settle(local)
                results = asyncio.run(
                    chaos.under_load(
                        local, MODEL, reqs, args.streams, lambda: asyncio.sleep(args.duration)
                    )
                )
            if ref.broken(results):
                raise RuntimeError(f"replication={on}: {ref.broken(results)}")
            row["on" if on else "off"] = tpot(results)
        row["ratio"] = row["on"] / row["off"]
        print(f"round {i + 1}: TPOT on {row['on'] * 1e3:.2f} ms, off {row['off'] * 1e3:.2f} ms, "
              f"ratio {row['ratio']:.3f}", flush=True)  # fmt: skip
        rounds.append(row)
    pooled = statistics.mean(r["on"] for r in rounds) / statistics.mean(r["off"] for r in rounds)
    return {"rounds": rounds, "pooled_ratio": pooled}


# -- rolling restart, a store node, Redis ----------------------------------------------------
def load_requests(args: argparse.Namespace) -> Iterator[ChaosRequest]:
    rng = random.Random(args.seed)
    return iter(chaos.make_requests(rng, 1000, prompt_len=(100, 300), max_tokens=args.output_len))


def run_rolling(args: argparse.Namespace, ref: Reference) -> dict[str, Any]:
    with cluster(args) as sup:
        local = sup.local
        chaos.settle(local)
        started = time.monotonic()
        results = asyncio.run(
            chaos.under_load(local, MODEL, load_requests(args), args.streams,
                             lambda: chaos.rolling_restart(local, ("prefill", "decode")))
        )  # fmt: skip
        migrated = metric_sum(local.gateway_url, "baton_failovers_total", 'reason="migrated"')
    bad = ref.broken(results)
    print(
        f"rolling restart of 2 prefill and {args.decode} decode instances in "
        f"{time.monotonic() - started:.0f}s"
        f": {len(results)} streams, {len(bad)} broken, {migrated:.0f} migrated",
        flush=True,
    )
    return {"streams": len(results), "broken": bad, "migrated": migrated}  # fmt: skip


def run_store(args: argparse.Namespace, ref: Reference) -> dict[str, Any]:
    with cluster(args, kvstore=2, replication=2) as sup:
        local = sup.local
        chaos.settle(local)
        results = asyncio.run(
            chaos.under_load(local, MODEL, load_requests(args), args.streams,
                             lambda: chaos.kill_instance(local, "kvstore-0", args.hold))
        )  # fmt: skip
    bad = ref.broken(results)
    print(f"store node killed: {len(results)} requests, {len(bad)} failed", flush=True)
    return {"requests": len(results), "broken": bad}


def run_redis(args: argparse.Namespace, ref: Reference) -> dict[str, Any]:
    back: dict[str, float] = {}
    with cluster(args) as sup:
        local = sup.local
        chaos.settle(local)
        members = len([s for s in local.specs if s.role != "gateway"])

        async def outage() -> None:
            back.update(await chaos.redis_outage(sup, args.down, members))

        results = asyncio.run(
            chaos.under_load(local, MODEL, load_requests(args), args.streams, outage)
        )
        chaos.settle(local)
        rng = random.Random(args.seed + 1)
        reqs = chaos.make_requests(
            rng, args.streams, prompt_len=(100, 300), max_tokens=args.output_len
        )
        after = asyncio.run(chaos.with_fault(local, MODEL, reqs, "kill"))
    bad = ref.broken(results)
    bad_after = ref.broken(after.results)
    print(f"Redis down {args.down:.0f}s: {len(results)} requests, {len(bad)} failed; back after "
          f"{json.dumps({k: round(v, 2) for k, v in back.items()})}; a kill after it: "
          f"{len(bad_after)} broken", flush=True)  # fmt: skip
    return {"requests": len(results), "broken": bad, "recovery_s": back, "kill_after": bad_after}


def run_soak(args: argparse.Namespace, ref: Reference) -> dict[str, Any]:
    """No fault: ``--duration`` seconds of saturating load with long prompts (``--prompt``
    tokens, ``--streams`` in flight); every failover counted is a false alarm."""
    rng = random.Random(args.seed)
    reqs = iter(
        chaos.make_requests(
            rng, 10_000, prompt_len=(args.prompt, args.prompt), max_tokens=args.output_len
        )
    )
    with cluster(args) as sup:
        local = sup.local
        chaos.settle(local)
        results = asyncio.run(
            chaos.under_load(local, MODEL, reqs, args.streams,
                             lambda: asyncio.sleep(args.duration))
        )  # fmt: skip
        failovers = {
            reason: metric_sum(local.gateway_url, "baton_failovers_total", f'reason="{reason}"')
            for reason in ("lost", "hung", "stalled", "failed", "migrated")
        }
    # before the token check, which recomputes every stream in this process (minutes)
    errors = [r.error for r in results if r.error]
    print(
        f"soak: {len(results)} streams ({len(errors)} with an error, e.g. "
        f"{errors[:1]}), failovers {failovers}",
        flush=True,
    )
    bad = ref.broken(results)
    print(f"soak: {len(results)} streams, {len(bad)} broken, failovers {failovers}", flush=True)
    return {"streams": len(results), "broken": bad, "failovers": failovers}


# -- gateways --------------------------------------------------------------------------------
def gateway_ids(local: LocalCluster) -> dict[str, str]:
    """Each live gateway's instance id -> its name in the cluster."""
    out = {}
    for spec in local.specs:
        if spec.role == "gateway":
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(f"http://127.0.0.1:{spec.http_port}/ready", timeout=2)
                out[r.json()["gateway"]] = spec.name
    return out


async def gateway_fault(
    local: LocalCluster,
    reqs: list[ChaosRequest],
    fault: chaos.Fault,
    after_tokens: int,
    spare: str | None,
) -> tuple[list[ResumedStream], str]:
    """Resumable streams through the balancer; once each has ``after_tokens``, the gateway
    producing most of them (on a tie, not ``spare``) gets ``fault``; every stream is read
    to its end."""
    async with httpx.AsyncClient(timeout=600) as http:
        streams = [ResumedStream(r, time.perf_counter()) for r in reqs]
        tasks = [
            asyncio.create_task(read_resumable(http, local.gateway_url, MODEL, s)) for s in streams
        ]
        victim = await fault_busiest(
            local, streams, tasks, lambda s: len(s.tokens), fault, after_tokens, spare
        )
        results = await asyncio.gather(*tasks)
    return list(results), victim


async def fault_busiest(
    local: LocalCluster,
    streams: Sequence[ResumedStream] | Sequence[ResumedResponse],
    tasks: list[asyncio.Task[Any]],
    progress: Callable[[Any], int],
    fault: chaos.Fault,
    after: int,
    spare: str | None,
) -> str:
    """Once every stream's ``progress`` reached ``after`` (or it ended), ``fault`` the
    gateway producing most of them (on a tie, not ``spare``); returns its name."""
    while not all(progress(s) >= after or t.done() for s, t in zip(streams, tasks, strict=True)):
        await asyncio.sleep(0.02)
    owners = collections.Counter(s.owner for s in streams if s.owner is not None)
    if not owners:
        raise RuntimeError(f"no stream started: {[s.error for s in streams]}")
    names = gateway_ids(local)
    victim = names[max(owners, key=lambda o: (owners[o], names[o] != spare))]
    chaos.apply_fault(local, victim, fault)
    return victim


async def responses_fault(
    local: LocalCluster,
    cases: list[ResponsesCase],
    fault: chaos.Fault,
    after_events: int,
    spare: str | None,
) -> tuple[list[ResumedResponse], str]:
    """:func:`gateway_fault` through the official SDK's Responses API: background
    responses streamed through the balancer, resumed with ``responses.stream(
    response_id=..., starting_after=...)``."""
    client = AsyncOpenAI(
        base_url=local.gateway_url + "/v1", api_key="none", max_retries=0, timeout=600
    )
    async with client:
        streams = [ResumedResponse(c) for c in cases]
        tasks = [asyncio.create_task(read_response(client, MODEL, s)) for s in streams]
        victim = await fault_busiest(
            local, streams, tasks, lambda s: len(s.seqs), fault, after_events, spare
        )
        results = await asyncio.gather(*tasks)
    return list(results), victim


WORDS = (
    "river stone lantern harbor orchard copper meadow signal winter canvas engine "
    "garden thunder paper island violet market bridge falcon silver shadow morning"
)


def responses_cases(rng: random.Random, n: int, max_tokens: int) -> list[ResponsesCase]:
    """``n`` unique text prompts of 60-200 words; every other one seeded, the rest greedy."""
    words = WORDS.split()
    return [
        ResponsesCase(
            "Write a short story using these words: "
            + " ".join(rng.choice(words) for _ in range(rng.randint(60, 200))),
            max_tokens,
            rng.randrange(1 << 30) if i % 2 else None,
        )
        for i in range(n)
    ]


def responses_broken(
    local: LocalCluster, ref: Reference, results: list[ResumedResponse]
) -> list[str]:
    """Each response's text against the same engine's, in this process, on the prompt
    the gateway templates from its input (read back as token ids from the chat API)."""
    reqs = []
    for r in results:
        chat = httpx.post(
            local.gateway_url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": r.case.input}],
                "max_completion_tokens": 1,
                "return_token_ids": True,
            },
            timeout=120,
        )
        chat.raise_for_status()
        prompt = chat.json()["prompt_token_ids"]
        reqs.append(ChaosRequest(prompt, r.case.max_output_tokens, r.case.seed, ignore_eos=False))
    expected = chaos.reference(ref.engine, reqs)
    out = []
    for i, (r, want) in enumerate(zip(results, expected, strict=True)):
        text = ref.engine.tokenizer.decode(want)
        if r.error is not None:
            out.append(f"response {i}: {r.error}")
        elif r.text != text or r.output_tokens != len(want):
            out.append(f"response {i}: {r.output_tokens} tokens, text differs: {r.text[:80]!r}")
    return out


def run_gateway(args: argparse.Namespace, ref: Reference) -> dict[str, Any]:
    rng = random.Random(args.seed)
    rounds: list[dict[str, Any]] = []
    with cluster(args, prefill=1, gateways=2) as sup:
        local = sup.local
        for i in range(args.rounds):
            chaos.settle(local)
            chaos.wait_ready(local, "gateway")
            reqs = chaos.make_requests(
                rng, args.streams, prompt_len=(100, 300), max_tokens=args.output_len
            )
            last = rounds[-1]["victim"] if rounds else None  # the rounds roll over both
            results: list[ResumedStream] | list[ResumedResponse]
            if args.api == "responses":
                cases = responses_cases(rng, args.streams, args.output_len)
                results, victim = asyncio.run(
                    responses_fault(local, cases, args.fault, args.output_len // 4, spare=last)
                )
                bad = responses_broken(local, ref, results)
            else:
                results, victim = asyncio.run(
                    gateway_fault(local, reqs, args.fault, args.output_len // 4, spare=last)
                )
                bad = ref.broken(results)
            gaps = [g for r in results for g in r.gaps]
            rounds.append({"victim": victim, "broken": bad, "gaps_s": gaps})
            worst = max(gaps, default=0.0)
            print(f"round {i + 1}: {victim} {args.fault}: {len(gaps)} streams resumed, "
                  f"broken {len(bad)}, worst gap {worst:.3f}s", flush=True)  # fmt: skip
    every = [g for r in rounds for g in r["gaps_s"]]
    return {
        "api": args.api,
        "fault": args.fault,
        "rounds": len(rounds),
        "streams": len(rounds) * args.streams,
        "resumed": len(every),
        "broken_streams": sum(len(r["broken"]) for r in rounds),
        "resume_gap_s": {"p50": pct(every, 0.5), "p99": pct(every, 0.99),
                         "max": max(every, default=float("nan"))},
        "per_round": rounds,
    }  # fmt: skip


def run_gateway_rolling(args: argparse.Namespace, ref: Reference) -> dict[str, Any]:
    """Every gateway drained (SIGTERM) and restarted in turn, ``--gateway-rounds`` times
    over, under a steady load of ``--streams`` resumable streams through the balancer."""
    with cluster(args, prefill=1, gateways=2) as sup:
        local = sup.local
        chaos.settle(local)
        chaos.wait_ready(local, "gateway")
        started = time.monotonic()

        async def restarts() -> None:
            for _ in range(args.gateway_rounds):
                await chaos.rolling_restart(local, ("gateway",))

        results = asyncio.run(
            resumable_under_load(local, load_requests(args), args.streams, restarts)
        )
        took = time.monotonic() - started
    bad = ref.broken(results)
    resumed = [r for r in results if r.gaps]
    print(
        f"rolling restart of 2 gateways x {args.gateway_rounds} in {took:.0f}s: "
        f"{len(results)} streams, {len(resumed)} resumed, {len(bad)} broken",
        flush=True,
    )
    return {
        "restarts": 2 * args.gateway_rounds,
        "streams": len(results),
        "resumed": len(resumed),
        "broken": bad,
        "gaps_s": [g for r in resumed for g in r.gaps],
    }


async def resumable_under_load(
    local: LocalCluster,
    requests: Iterator[ChaosRequest],
    concurrency: int,
    during: Callable[[], Awaitable[None]],
) -> list[ResumedStream]:
    """Run ``during`` while ``concurrency`` clients keep resumable streams going through
    the balancer (each sends its next request as soon as its last ended)."""
    results: list[ResumedStream] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as http:

        async def client() -> None:
            while not stop.is_set() and (req := next(requests, None)) is not None:
                out = ResumedStream(req, time.perf_counter())
                results.append(out)
                await read_resumable(http, local.gateway_url, MODEL, out)

        tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
        while sum(len(r.tokens) for r in results) < 3 * concurrency:
            await asyncio.sleep(0.05)
        await during()
        stop.set()
        await asyncio.gather(*tasks)
    return results


SCENARIOS: dict[str, Callable[[argparse.Namespace, Reference], dict[str, Any]]] = {
    "chaos": run_chaos,
    "e2e": run_e2e,
    "replication": run_replication,
    "rolling": run_rolling,
    "store": run_store,
    "redis": run_redis,
    "soak": run_soak,
    "gateway": run_gateway,
    "gateway-rolling": run_gateway_rolling,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--fault", choices=["kill", "stop", "term"], default="kill")
    p.add_argument(
        "--api", choices=["completions", "responses"], default="completions",
        help="gateway: resumable completions (the reference client) or background "
        "Responses API streams (the official SDK)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--streams", type=int, default=4, help="concurrent streams")
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--decode", type=int, default=3, help="decode instances")
    p.add_argument(
        "--duration", type=float, default=30.0, help="replication, soak: seconds of load"
    )
    p.add_argument(
        "--gateway-rounds", type=int, default=3,
        help="gateway-rolling: times every gateway is restarted",
    )  # fmt: skip
    p.add_argument("--hold", type=float, default=30.0, help="store: seconds of load after the kill")
    p.add_argument("--down", type=float, default=10.0, help="seconds Redis is down")
    p.add_argument("--prompt", type=int, default=2048, help="soak: prompt tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", type=Path, default=None, help="keep service logs here")
    p.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    args = p.parse_args()
    result = SCENARIOS[args.scenario](args, Reference())
    save_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "per_round"}, indent=2))


if __name__ == "__main__":
    main()
