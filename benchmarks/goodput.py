"""Goodput under latency SLOs: Baton against vLLM's CPU build, same machine, same load.

DistServe's measure: the share of requests that meet both targets (TTFT within
``--slo-ttft``, TPOT within each of ``--tpot-targets``), and goodput = that share
x the offered rate. Each server runs alone (never two at once), started as a user
starts it (peers.py's servers), and takes the same open-loop Poisson arrivals of
unique token-id prompts with forced output lengths at every rate in ``--rates``,
``--repeats`` times (single runs of 30 requests are noisy: the table's last row
averages over rates and repeats). A failed request meets no target.

Baton variants (``--baton-variant LABEL=ARGS``, e.g. ``paced=--slo-ttft 3
--slo-tpot 0.1``) are extra ``baton up`` runs; with ``--slo-tpot`` set, decode
paces its steps to that target (shared/engine/step_pacer.py).

``--trace`` replays the first ``--num-prompts`` rows of an Azure LLM inference
trace (CSV) instead, lengths scaled by ``--token-scale`` and clamped, arrivals
(bursts kept) scaled so that their mean rate is each rate of the ladder.

Goodput (DistServe): the highest rate of the ladder at which at least 90% of
requests meet both targets (averaged over repeats). ``attainment.png`` draws
attainment against rate and, at ``--scale-rate``, against the SLO scale (both
targets multiplied by a factor, from the same requests).

    python -m benchmarks.goodput --vllm-python /work/peers/vllm-venv/bin/python \\
        --baton-variant 'paced 0.1=--slo-ttft 3 --slo-tpot 0.1' --out bench-results/goodput
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.peers import Running, Server, baton_servers, measure, vllm_on_batons_model
from benchmarks.peers import Scenario as Warmup
from shared.bench import workload as wl
from shared.bench.metrics import RequestResult
from shared.bench.runner import Target, run_open_loop

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class RateRun:
    """One server at one offered rate: latencies' medians and attainment per target."""

    rate: float
    repeat: int
    requests: int
    failed: int
    ttft_p50: float | None
    tpot_p50: float | None
    ttft_met: float  # share within the TTFT target alone
    met: dict[str, float]  # TPOT target (as text) -> share meeting TTFT and that TPOT
    # (TTFT, TPOT) of each request, None where it failed: attainment at other SLOs
    samples: tuple[tuple[float | None, float | None], ...] = ()


def attainment(
    results: Sequence[RequestResult], slo_ttft: float, tpot_targets: Sequence[float]
) -> tuple[float, dict[str, float]]:
    """Share within the TTFT target, and within it and each TPOT target (a one-token
    output has no TPOT to miss; a failed request misses all)."""
    n = len(results)
    fast = [r for r in results if r.ttft is not None and r.ttft <= slo_ttft]
    met = {
        f"{t:g}": sum(1 for r in fast if (r.tpot or 0.0) <= t) / n if n else 0.0
        for t in tpot_targets
    }
    return (len(fast) / n if n else 0.0), met


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


GOODPUT_SHARE = 0.9  # goodput: the highest rate with at least this share within both


def trace_specs(
    rows: Sequence[wl.TraceRow], rate: float, args: argparse.Namespace, seed: int
) -> list[wl.RequestSpec]:
    """The first ``num_prompts`` rows, arrivals scaled to a mean of ``rate`` req/s."""
    head = rows[: args.num_prompts]
    span = head[-1].offset_s - head[0].offset_s
    natural = (len(head) - 1) / span if span > 0 else rate
    return wl.from_trace(
        rows, n=args.num_prompts, time_scale=rate / natural, token_scale=args.token_scale,
        max_input=args.max_input, max_output=args.max_output, seed=seed,
    )  # fmt: skip


async def one_rate(
    url: str, rate: float, args: argparse.Namespace, seed: int
) -> list[RequestResult]:
    if args.trace is not None:
        specs = trace_specs(wl.load_trace(args.trace), rate, args, seed)
    else:
        times = wl.arrivals(args.num_prompts, rate, 1.0, np.random.default_rng(seed))
        specs = wl.synthetic(args.num_prompts, args.input_len, args.output_len, times, seed)
    results, _ = await run_open_loop(Target(url, MODEL), specs, lambda: None)
    return results


def share_within(run: RateRun, ttft_s: float, tpot_s: float) -> float:
    """Share of a run's requests within both targets (a failed one misses)."""
    n = len(run.samples)
    ok = sum(
        1
        for ttft, tpot in run.samples
        if ttft is not None and ttft <= ttft_s and (tpot or 0.0) <= tpot_s
    )
    return ok / n if n else 0.0


def goodput(runs: Sequence[RateRun], target: str) -> float:
    """The highest rate at which the runs' mean share within TTFT and ``target`` is at
    least :data:`GOODPUT_SHARE`, every lower rate included (0: none)."""
    best = 0.0
    for rate in sorted({r.rate for r in runs}):
        at = [r.met[target] for r in runs if r.rate == rate]
        if statistics.mean(at) < GOODPUT_SHARE:
            break
        best = rate
    return best


def run_server(server: Server, args: argparse.Namespace) -> list[RateRun] | str:
    slug = "".join(c if c.isalnum() else "-" for c in server.name.lower()).strip("-")
    running = Running(server, args.out / f"{slug}.log")
    runs: list[RateRun] = []
    try:
        print(f"{server.name}: ready in {running.wait_ready():.0f} s", flush=True)
        asyncio.run(measure(running.url, Warmup("warm-up", 64, 8, 2, 2), seed=99))
        for repeat in range(args.repeats):
            for i, rate in enumerate(args.rates):
                seed = 1000 * repeat + i  # the same arrivals and prompts for every server
                results = asyncio.run(one_rate(running.url, rate, args, seed))
                ttft_met, met = attainment(results, args.slo_ttft, args.tpot_targets)
                run = RateRun(
                    rate=rate,
                    repeat=repeat,
                    requests=len(results),
                    failed=sum(1 for r in results if not r.ok),
                    ttft_p50=_median([r.ttft for r in results]),
                    tpot_p50=_median([r.tpot for r in results]),
                    ttft_met=ttft_met,
                    met=met,
                    samples=tuple((r.ttft, r.tpot) if r.ok else (None, None) for r in results),
                )
                runs.append(run)
                print(f"  {describe(run)}", flush=True)
    except RuntimeError as exc:
        print(f"{server.name}: {exc}", flush=True)
        return str(exc)
    finally:
        running.stop()
    return runs


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.0f} ms"


def describe(run: RateRun) -> str:
    shares = " / ".join(f"{v:.0%}" for v in run.met.values())
    return (
        f"{run.rate:g} req/s (repeat {run.repeat}): TTFT {_ms(run.ttft_p50)}, TPOT "
        f"{_ms(run.tpot_p50)}, TTFT met {run.ttft_met:.0%}, both met {shares}"
        + (f", {run.failed} failed" if run.failed else "")
    )


def table(results: dict[str, list[RateRun] | str], args: argparse.Namespace) -> str:
    targets = " / ".join(f"{t * 1e3:g}" for t in args.tpot_targets)
    load = (
        f"the first {args.num_prompts} requests of {args.trace.name}, lengths x "
        f"{args.token_scale:g} clamped to {args.max_input} in / {args.max_output} out"
        if args.trace is not None
        else f"{args.num_prompts} Poisson arrivals per rate, {args.input_len} in / "
        f"{args.output_len} out"
    )
    lines = [
        f"Requests meeting TTFT <= {args.slo_ttft:g} s and TPOT <= {targets} ms "
        f"({load}, {args.repeats} repeat(s))",
        "",
        "| server | rate | TTFT p50 | TPOT p50 | TTFT met | both met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in results.items():
        if isinstance(runs, str):
            lines.append(f"| {name} | - | - | - | - | {runs} |")
            continue
        for rate in args.rates:
            at = [r for r in runs if r.rate == rate]
            met = " / ".join(f"{statistics.mean(r.met[k] for r in at):.0%}" for k in at[0].met)
            lines.append(
                f"| {name} | {rate:g} | {_ms(_median([r.ttft_p50 for r in at]))} | "
                f"{_ms(_median([r.tpot_p50 for r in at]))} | "
                f"{statistics.mean(r.ttft_met for r in at):.0%} | {met} |"
            )
        mean = " / ".join(f"{statistics.mean(r.met[k] for r in runs):.0%}" for k in runs[0].met)
        lines.append(
            f"| {name} | mean | | | {statistics.mean(r.ttft_met for r in runs):.0%} | {mean} |"
        )
        best = " / ".join(f"{goodput(runs, k):g}" for k in runs[0].met)
        lines.append(f"| {name} | goodput (req/s) | | | | {best} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, list[RateRun] | str], args: argparse.Namespace, out: Path) -> None:
    """Attainment within TTFT and each TPOT target against rate (one panel per target),
    and at ``--scale-rate`` against the SLO scale (both targets times a factor), as
    DistServe draws them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {name: runs for name, runs in results.items() if not isinstance(runs, str) and runs}
    targets = [f"{t:g}" for t in args.tpot_targets]
    fig, axes = plt.subplots(1, len(targets) + 1, figsize=(4.2 * (len(targets) + 1), 3.6))
    for ax, target in zip(axes, targets, strict=False):
        for name, runs in ran.items():
            rates = sorted({r.rate for r in runs})
            shares = [statistics.mean(r.met[target] for r in runs if r.rate == x) for x in rates]
            ax.plot(rates, [100 * v for v in shares], marker="o", label=name)
        ax.axhline(100 * GOODPUT_SHARE, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"TTFT <= {args.slo_ttft:g} s, TPOT <= {float(target) * 1e3:g} ms")
        ax.set_xlabel("rate (req/s)")
        ax.set_ylabel("within both (%)")
        ax.set_ylim(-5, 105)
    scale_rate = args.scale_rate if args.scale_rate is not None else max(args.rates)
    scales = [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]
    middle = args.tpot_targets[len(args.tpot_targets) // 2]
    ax = axes[-1]
    for name, runs in ran.items():
        at = [r for r in runs if r.rate == scale_rate]
        if not at:
            continue
        shares = [
            statistics.mean(share_within(r, args.slo_ttft * k, middle * k) for r in at)
            for k in scales
        ]
        ax.plot(scales, [100 * v for v in shares], marker="o", label=name)
    ax.axhline(100 * GOODPUT_SHARE, color="grey", linestyle=":", linewidth=1)
    ax.set_title(f"{scale_rate:g} req/s; SLO scale x ({args.slo_ttft:g} s, {middle * 1e3:g} ms)")
    ax.set_xlabel("SLO scale")
    ax.set_ylim(-5, 105)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baton-python", default=sys.executable)
    p.add_argument("--no-baton", action="store_true", help="skip plain `baton up`")
    p.add_argument(
        "--baton-variant", action="append", default=[], metavar="LABEL=ARGS",
        help="also run `baton up ARGS`",
    )  # fmt: skip
    p.add_argument("--vllm-python", default=None, help="python of vLLM's venv (else skipped)")
    p.add_argument("--vllm-threads", type=int, default=2)
    p.add_argument("--rates", type=float, nargs="+", default=[0.4, 0.8, 1.2, 1.6])
    p.add_argument("--num-prompts", type=int, default=30, help="per rate")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--trace", type=Path, default=None, help="Azure trace CSV instead")
    p.add_argument("--token-scale", type=float, default=0.5, help="trace lengths x this")
    p.add_argument("--max-input", type=int, default=1024, help="trace prompts cut to this")
    p.add_argument("--max-output", type=int, default=256, help="trace outputs cut to this")
    p.add_argument(
        "--scale-rate", type=float, default=None,
        help="rate of the attainment-against-SLO-scale plot (default: the highest)",
    )  # fmt: skip
    p.add_argument("--slo-ttft", type=float, default=3.0, help="seconds")
    p.add_argument(
        "--tpot-targets", type=float, nargs="+", default=[0.05, 0.1, 0.25], help="seconds"
    )
    p.add_argument("--out", type=Path, default=Path("bench-results/goodput"))
    return p.parse_args(argv)


def servers(args: argparse.Namespace) -> list[Server]:
    out = baton_servers(args.baton_python, args.baton_variant, plain=not args.no_baton)
    if args.vllm_python:
        out.append(vllm_on_batons_model(args.vllm_python, args.vllm_threads))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {s.name: run_server(s, args) for s in servers(args)}
    body = {
        name: runs if isinstance(runs, str) else [asdict(r) for r in runs]
        for name, runs in results.items()
    }
    (args.out / "goodput.json").write_text(json.dumps(body, indent=1))
    text = table(results, args)
    (args.out / "goodput.md").write_text(text)
    plot(results, args, args.out / "attainment.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
