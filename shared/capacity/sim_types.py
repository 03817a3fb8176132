"""What a simulation of a deployment takes (the requests, the deployment) and gives
(each request's outcome, each instance's work): :mod:`shared.capacity.simulator`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    input_len: int
    output_len: int
    block_ids: tuple[int, ...] = ()  # prefix-hash ids (chained), one per block_tokens
    block_tokens: int = 0


@dataclass(frozen=True)
class Deployment:
    prefill: int
    decode: int
    threads: int = 1  # per instance
    max_batched_tokens: int = 2048
    max_seqs: int = 64
    # decode steps start no closer than this while a prefill instance computes (a TPOT
    # target: ``baton up --slo-tpot`` paces decode, shared/engine/step_pacer.py); 0: never
    pace_s: float = 0.0

    @property
    def threads_total(self) -> int:
        return (self.prefill + self.decode) * self.threads

    def describe(self) -> str:
        return (
            f"{self.prefill}P:{self.decode}D, {self.threads} thread(s) each, "
            f"batch <= {self.max_seqs} seqs / {self.max_batched_tokens} tokens"
            + (f", decode paced to {self.pace_s * 1000:.0f} ms" if self.pace_s else "")
        )


@dataclass(frozen=True)
class RequestOutcome:
    ttft_s: float
    tpot_s: float
    finished_s: float

    def meets(self, slo_ttft: float, slo_tpot: float) -> bool:
        return self.ttft_s <= slo_ttft and self.tpot_s <= slo_tpot


@dataclass(frozen=True)
class InstanceStats:
    """What one instance's engine did in the simulation (``benchmarks.split_cpu`` puts
    the same figures, measured, beside these)."""

    role: str  # "prefill" or "decode"
    steps: int
    work_s: float  # its steps' CPU seconds at full speed
    busy_s: float  # the wall seconds they took on the shared cores

    @property
    def share(self) -> float:
        """The share of a core (per thread) its engine got while stepping."""
        return self.work_s / self.busy_s if self.busy_s > 0 else 0.0


@dataclass(frozen=True)
class SideStats:
    """CPU a process beside the engines was charged in the simulation: ``cluster`` (the
    gateway, the KV store and Redis), ``workers`` (the workers' threads beside their
    engine's) or ``client`` (the load generator, when it shares the cores)."""

    name: str
    cpu_s: float


@dataclass(frozen=True)
class SimResult:
    deployment: Deployment
    outcomes: tuple[RequestOutcome, ...]
    duration_s: float
    instances: tuple[InstanceStats, ...] = ()  # prefill instances first
    sides: tuple[SideStats, ...] = ()

    def goodput(self, slo_ttft: float, slo_tpot: float) -> float:
        met = sum(o.meets(slo_ttft, slo_tpot) for o in self.outcomes)
        return met / self.duration_s if self.duration_s > 0 else 0.0
