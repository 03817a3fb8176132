"""``baton plan``: which deployment serves a workload best on N cores, by simulation.

Candidates are every prefill:decode split and threads per instance whose
threads fit the cores (``oversubscribe`` > 1 also admits splits that share
cores, which ``baton up`` can start), times each batch limit given. Each is
simulated (:mod:`shared.capacity.simulator`) on the workload against the
profile, and ranked by predicted goodput (requests per second meeting both
SLOs), then by predicted TTFT p50.

Workloads: the Azure LLM inference trace CSV (TIMESTAMP, ContextTokens,
GeneratedTokens) or the prefix-hash JSON-lines format (timestamp in ms,
input_length, output_length, hash_ids), read with ``baton bench``'s own
loaders and scaled the same way (``time_scale`` < 1 stretches arrivals,
``token_scale`` shrinks lengths, then clamped), so a plan and a measurement
see the same requests.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.bench import prefix_trace
from shared.bench.workload import TraceFormatError, load_trace
from shared.capacity.profile import Profile
from shared.capacity.sim_types import Deployment, SimRequest, SimResult
from shared.capacity.simulator import simulate
from shared.engine.step_pacer import PACE_MARGIN


@dataclass(frozen=True)
class Candidate:
    deployment: Deployment
    goodput: float
    ttft_p50: float
    tpot_p50: float
    oversubscribed: bool


def load_workload(
    path: Path,
    *,
    n: int | None = None,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    max_input: int = 4096,
    max_output: int = 512,
    block_tokens: int = 512,
) -> list[SimRequest]:
    """A trace in either format (told apart by its first character), scaled as ``baton
    bench --time-scale --token-scale`` scales it."""
    if time_scale <= 0 or token_scale <= 0:
        raise ValueError("time and token scales must be positive")
    try:
        head = path.read_text()[:1]
    except OSError as exc:
        raise TraceFormatError(f"cannot read workload {path}: {exc}") from exc

    def tokens(x: int, cap: int) -> int:
        return max(1, min(cap, round(x * token_scale)))

    out: list[SimRequest] = []
    if head == "{":
        for row in prefix_trace.load(path)[:n]:
            ids = row.hash_ids
            keep = max(1, round(len(ids) * token_scale)) if ids else 0
            out.append(
                SimRequest(
                    row.timestamp_ms / 1000 / time_scale,
                    tokens(row.input_length, max_input),
                    tokens(row.output_length, max_output),
                    tuple(ids[:keep]),
                    max(1, round(block_tokens * token_scale)),
                )
            )
    else:
        for r in load_trace(path)[:n]:
            out.append(
                SimRequest(
                    r.offset_s / time_scale,
                    tokens(r.context_tokens, max_input),
                    tokens(r.generated_tokens, max_output),
                )
            )
    return out


def candidates(
    cores: int,
    threads_options: Sequence[int],
    max_seqs_options: Sequence[int],
    *,
    max_batched_tokens: int = 2048,
    oversubscribe: float = 1.0,
    slo_tpot: float | None = None,
) -> list[Deployment]:
    """``slo_tpot``: decode paced as ``baton up --slo-tpot`` paces it."""
    pace_s = PACE_MARGIN * slo_tpot if slo_tpot else 0.0
    out = []
    limit = cores * oversubscribe
    for t in threads_options:
        for p in range(1, cores * 2 + 1):
            for d in range(1, cores * 2 + 1):
                if (p + d) * t > limit:
                    continue
                for seqs in max_seqs_options:
                    out.append(Deployment(p, d, t, max_batched_tokens, seqs, pace_s))
    return out


def evaluate(
    requests: Sequence[SimRequest],
    deployments: Sequence[Deployment],
    profile: Profile,
    cores: int,
    slo_ttft: float,
    slo_tpot: float,
    *,
    client_on_host: bool = False,
) -> list[Candidate]:
    """Every deployment simulated; best first."""
    ranked = []
    for dep in deployments:
        res = simulate(requests, dep, profile, cores, client_on_host=client_on_host)
        ranked.append(_candidate(res, cores, slo_ttft, slo_tpot))
    ranked.sort(key=lambda c: (-c.goodput, c.ttft_p50))
    return ranked


def _candidate(res: SimResult, cores: int, slo_ttft: float, slo_tpot: float) -> Candidate:
    ttfts = [o.ttft_s for o in res.outcomes] or [0.0]
    tpots = [o.tpot_s for o in res.outcomes] or [0.0]
    return Candidate(
        res.deployment,
        res.goodput(slo_ttft, slo_tpot),
        statistics.median(ttfts),
        statistics.median(tpots),
        res.deployment.threads_total > cores,
    )


def table(ranked: Sequence[Candidate], slo_ttft: float, slo_tpot: float) -> str:
    lines = [
        f"predicted goodput: requests/s with TTFT <= {slo_ttft:g} s and TPOT <= {slo_tpot:g} s",
        "| rank | deployment | goodput (req/s) | TTFT p50 | TPOT p50 | shares cores |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, c in enumerate(ranked, start=1):
        lines.append(
            f"| {i} | {c.deployment.describe()} | {c.goodput:.3f} | {c.ttft_p50 * 1000:.0f} ms"
            f" | {c.tpot_p50 * 1000:.1f} ms | {'yes' if c.oversubscribed else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def up_command(dep: Deployment, slo_ttft: float, slo_tpot: float, model: str | None = None) -> str:
    """The ``baton up`` that runs ``dep`` as simulated: fixed threads per instance, the
    batch limits (environment, where not the defaults) and the same SLOs, which make
    decode pace its steps as the simulation did; ``model``: the profiled model where it
    is not the default."""
    env = []
    if dep.max_seqs != Deployment.max_seqs:
        env.append(f"BATON_MAX_NUM_SEQS={dep.max_seqs}")
    if dep.max_batched_tokens != Deployment.max_batched_tokens:
        env.append(f"BATON_MAX_NUM_BATCHED_TOKENS={dep.max_batched_tokens}")
    args = [
        "baton up",
        f"--prefill {dep.prefill} --decode {dep.decode}",
        f"--threads {dep.threads} --max-threads {dep.threads}",
        f"--slo-ttft {slo_ttft:g} --slo-tpot {slo_tpot:g}",
    ]
    if model is not None:
        args.append(f"--model {model}")
    return " ".join([*env, *args])
