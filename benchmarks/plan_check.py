"""The planner against measurement: predicted and measured goodput of each split.

For each prefill:decode split given, ``baton plan``'s simulation (on the saved
profile, ``baton profile``) predicts goodput, TTFT and TPOT for the trace; then
``baton up --prefill P --decode D --max-threads 1`` (fixed threads, as the
simulation assumes) serves the same requests (``baton bench``'s trace replay:
the same scaling, arrivals and lengths) and the same figures are measured.
Printed: both rankings and each split's predicted / measured goodput; with
``--repeats N`` each split is measured N times, round-robin, and the median of
its runs is compared (every run is printed and saved too).

    python -m benchmarks.plan_check \\
        --trace ../shared/workloads/azure-2023/AzureLLMInferenceTrace_conv.csv \\
        --num-requests 60 --time-scale 1 --token-scale 0.5 --slo-ttft 3 --slo-tpot 0.1 \\
        --splits 1:1 1:2 2:1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.peers import MODEL, Running, baton_server
from shared.bench import workload as wl
from shared.bench.metrics import SLO, summarize
from shared.bench.runner import Target, run_open_loop
from shared.capacity.command import default_profile_path
from shared.capacity.plan import evaluate, load_workload
from shared.capacity.profile import load
from shared.capacity.sim_types import Deployment


def measure_split(
    args: argparse.Namespace,
    prefill: int,
    decode: int,
    extra: Sequence[str] = ("--max-threads", "1"),
    label: str = "",
) -> dict[str, float]:
    """``baton up --prefill P --decode D EXTRA`` serving the trace; its figures."""
    name = f"{prefill}P:{decode}D{label}"
    server = baton_server(
        args.python, name, ["--prefill", str(prefill), "--decode", str(decode), *extra]
    )
    tag = f"{prefill}p{decode}d{label.strip().replace(' ', '-')}"
    running = Running(server, args.out / f"baton-{tag}.log")
    rows = wl.load_trace(args.trace)
    specs = wl.from_trace(
        rows,
        n=args.num_requests,
        time_scale=args.time_scale,
        token_scale=args.token_scale,
        max_input=args.max_input,
        max_output=args.max_output,
    )
    try:
        running.wait_ready()
        results, duration = asyncio.run(run_open_loop(Target(running.url, MODEL), specs, _quiet))
    finally:
        running.stop()
    s = summarize(results, duration, SLO(ttft=args.slo_ttft, tpot=args.slo_tpot))
    return {
        "goodput": s.goodput or 0.0,
        "ttft_p50": s.ttft.median,
        "tpot_p50": s.tpot.median,
        "failed": float(s.failed),
    }


def _quiet() -> None:
    return None


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """What :func:`measure_split` reads: the server's python, the trace, its scaling, SLOs."""
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--token-scale", type=float, default=0.5)
    p.add_argument("--max-input", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--slo-ttft", type=float, default=3.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_trace_arguments(p)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--splits", nargs="+", default=["1:1", "1:2", "2:1"], help="P:D")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of each split, interleaved; medians compared"
    )
    p.add_argument("--profile", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("bench-results/plan-check"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    profile = load(args.profile or default_profile_path())
    splits = [(int(p), int(d)) for p, d in (s.split(":") for s in args.splits)]
    requests = load_workload(
        args.trace,
        n=args.num_requests,
        time_scale=args.time_scale,
        token_scale=args.token_scale,
        max_input=args.max_input,
        max_output=args.max_output,
    )
    deployments = [Deployment(p, d, 1) for p, d in splits]
    predicted = {
        (c.deployment.prefill, c.deployment.decode): c
        for c in evaluate(
            requests,
            deployments,
            profile,
            args.cores,
            args.slo_ttft,
            args.slo_tpot,
            client_on_host=True,  # the load generator runs beside the cluster here
        )
    }
    runs: dict[tuple[int, int], list[dict[str, float]]] = {split: [] for split in splits}
    for round_ in range(args.repeats):  # round-robin: drift on the host hits every split
        for p, d in splits:
            runs[(p, d)].append(measure_split(args, p, d))
            print(f"run {round_ + 1}/{args.repeats} {p}P:{d}D: {runs[(p, d)][-1]}", flush=True)
    rows: list[dict[str, Any]] = []
    for p, d in splits:
        c = predicted[(p, d)]
        goodputs = [m["goodput"] for m in runs[(p, d)]]
        rows.append(
            {
                "split": f"{p}P:{d}D",
                "predicted_goodput": c.goodput,
                "measured_goodput": statistics.median(goodputs),
                "measured_goodput_runs": goodputs,
                "predicted_ttft_p50": c.ttft_p50,
                "measured_ttft_p50": statistics.median(m["ttft_p50"] for m in runs[(p, d)]),
                "predicted_tpot_p50": c.tpot_p50,
                "measured_tpot_p50": statistics.median(m["tpot_p50"] for m in runs[(p, d)]),
                "failed": sum(m["failed"] for m in runs[(p, d)]),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    by_pred = [r["split"] for r in sorted(rows, key=lambda r: -r["predicted_goodput"])]
    by_meas = [r["split"] for r in sorted(rows, key=lambda r: -r["measured_goodput"])]
    (args.out / "plan-check.json").write_text(json.dumps(rows, indent=1))
    print(f"predicted ranking: {by_pred}\nmeasured ranking:  {by_meas}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
