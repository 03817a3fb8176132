"""Where a split's cores go: each engine's steps and its share of a core, measured and
simulated.

``baton plan`` simulates the cores as processor sharing: every busy thread gets an
equal share. This serves a trace on a local cluster (one thread per instance, as
``plan_check`` runs it) and reads, for every prefill and decode instance, the steps
its engine took and their wall time (its ``baton_engine_step_seconds`` series) and
the CPU of its ``baton-engine`` thread. CPU over wall time is the share of a core
the engine got while it stepped. Then the CPU of what runs beside the engines: the
gateway, the KV store and Redis (``cluster``), the workers' other threads
(``workers``), and this process, the load generator (``client``). Beside each, the
simulation's figures for the same trace, split and profile
(:class:`~shared.capacity.sim_types.InstanceStats`, ``SideStats``).

    python -m benchmarks.split_cpu \\
        --trace ../shared/workloads/azure-2023/AzureLLMInferenceTrace_conv.csv \\
        --time-scale 3 --splits 1:2 1:1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.peers import MODEL
from benchmarks.plan_check import add_trace_arguments
from shared.bench import workload as wl
from shared.bench.metrics import SLO, summarize
from shared.bench.runner import Target, run_open_loop
from shared.bench.scrape import metric_sum
from shared.capacity.command import default_profile_path
from shared.capacity.plan import load_workload
from shared.capacity.profile import load
from shared.capacity.sim_types import Deployment, InstanceStats, SideStats
from shared.capacity.simulator import simulate
from shared.engine.engine_loop import ENGINE_THREAD
from shared.launcher import LocalCluster, ServiceSpec, Topology
from shared.procs import PortPicker, cpu_seconds


@dataclass(frozen=True)
class Counters:
    """One worker's engine counters at a moment."""

    steps: float
    step_s: float  # wall seconds of those steps
    engine_cpu_s: float  # CPU seconds of its engine thread
    other_cpu_s: float  # CPU seconds of its other threads

    def since(self, before: Counters, role: str) -> InstanceStats:
        return InstanceStats(
            role,
            round(self.steps - before.steps),
            self.engine_cpu_s - before.engine_cpu_s,
            self.step_s - before.step_s,
        )


def read_counters(client: httpx.Client, spec: ServiceSpec, pid: int) -> Counters:
    url = f"http://127.0.0.1:{spec.http_port}"
    other = cpu_seconds(pid, except_thread=ENGINE_THREAD)
    return Counters(
        metric_sum(url, "baton_engine_step_seconds_count", client=client),
        metric_sum(url, "baton_engine_step_seconds_sum", client=client),
        cpu_seconds(pid) - other,
        other,
    )


@dataclass(frozen=True)
class Measured:
    """A split serving the trace: the run's summary, each engine, and the side CPU."""

    summary: dict[str, float]
    instances: list[InstanceStats]
    sides: list[SideStats]


def measure(split: Deployment, specs: list[wl.RequestSpec], slo: SLO, transport: str) -> Measured:
    """Serve ``specs`` on a local ``split`` (one thread per instance), prefill
    instances first."""
    picker = PortPicker()

    def topology(redis_url: str) -> Topology:
        return Topology(
            redis_url=redis_url,
            prefill=split.prefill,
            decode=split.decode,
            gateway_port=picker(),
            ports=picker,
            transport=transport,
            threads=split.threads,
        )

    with tempfile.TemporaryDirectory(prefix="baton-split-cpu-") as logs:
        cluster = LocalCluster(topology, log_dir=Path(logs)).start()
        try:
            workers = [s for r in ("prefill", "decode") for s in cluster.specs if s.role == r]
            pids = {s.name: cluster.pid_of(s) for s in workers}
            side_pids = cluster.pids({"gateway", "kvstore", "redis"})
            with httpx.Client(timeout=10.0) as client:

                def snapshot() -> dict[str, Counters]:
                    out = {}
                    for s in workers:
                        pid = pids[s.name]
                        if pid is None:
                            raise RuntimeError(f"{s.name} is not running")
                        out[s.name] = read_counters(client, s, pid)
                    return out

                before, cluster0, client0 = snapshot(), _cpu(side_pids), time.process_time()
                target = Target(cluster.gateway_url, MODEL)
                results, duration = asyncio.run(run_open_loop(target, specs, _quiet))
                client_cpu = time.process_time() - client0
                after, cluster_cpu = snapshot(), _cpu(side_pids) - cluster0
        finally:
            cluster.stop()
    s = summarize(results, duration, slo)
    summary = {
        "goodput": s.goodput or 0.0,
        "ttft_p50": s.ttft.median,
        "tpot_p50": s.tpot.median,
        "duration_s": duration,
        "failed": float(s.failed),
    }
    others = sum(after[w.name].other_cpu_s - before[w.name].other_cpu_s for w in workers)
    return Measured(
        summary,
        [after[w.name].since(before[w.name], w.role) for w in workers],
        [
            SideStats("cluster", cluster_cpu),
            SideStats("workers", others),
            SideStats("client", client_cpu),
        ],
    )


def _cpu(pids: Sequence[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


def _quiet() -> None:
    return None


def _line(label: str, i: InstanceStats) -> str:
    return (
        f"  {label:<9} {i.role:<7} steps {i.steps:5d}  engine CPU {i.work_s:5.1f} s"
        f"  stepping {i.busy_s:5.1f} s  share of a core {i.share:.2f}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_trace_arguments(p)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--splits", nargs="+", default=["1:1", "1:2", "2:1"], help="P:D")
    p.add_argument("--transport", choices=["tcp", "ucx"], default="ucx")
    p.add_argument("--profile", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("bench-results/split-cpu"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    profile = load(args.profile or default_profile_path())
    scale = {
        "n": args.num_requests,
        "time_scale": args.time_scale,
        "token_scale": args.token_scale,
        "max_input": args.max_input,
        "max_output": args.max_output,
    }
    sim_requests = load_workload(args.trace, **scale)
    specs = wl.from_trace(wl.load_trace(args.trace), **scale)
    slo = SLO(ttft=args.slo_ttft, tpot=args.slo_tpot)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for text in args.splits:
        p, d = (int(x) for x in text.split(":"))
        split = Deployment(p, d, threads=1)
        sim = simulate(sim_requests, split, profile, args.cores, client_on_host=True)
        got = measure(split, specs, slo, args.transport)
        print(
            f"{p}P:{d}D  goodput {got.summary['goodput']:.3f} measured, "
            f"{sim.goodput(args.slo_ttft, args.slo_tpot):.3f} simulated; "
            f"run {got.summary['duration_s']:.1f} s measured, {sim.duration_s:.1f} s simulated"
        )
        for m, s in zip(got.instances, sim.instances, strict=True):
            print(_line("measured", m))
            print(_line("simulated", s))
        charged = {side.name: side.cpu_s for side in sim.sides}
        for side in got.sides:
            print(
                f"  beside the engines: {side.name:<8} CPU {side.cpu_s:5.1f} s measured, "
                f"{charged.get(side.name, 0.0):5.1f} s simulated"
            )
        rows.append(
            {
                "split": f"{p}P:{d}D",
                **got.summary,
                "measured": [asdict(m) for m in got.instances],
                "simulated": [asdict(s) for s in sim.instances],
                "sides_measured": [asdict(s) for s in got.sides],
                "sides_simulated": [asdict(s) for s in sim.sides],
            }
        )
    (args.out / "split_cpu.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
