"""Benchmark output: a JSON result file, a one-screen text summary, and a PNG
(TTFT and TPOT CDFs per run; throughput and latency against request rate for a
sweep)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.bench.metrics import Distribution, RequestResult, Summary


@dataclass(frozen=True)
class RunReport:
    label: str  # e.g. "rate=2.0"
    request_rate: float | None
    summary: Summary
    results: list[RequestResult]
    validity: dict[str, Any] | None = None  # structured and tools: outputs checked

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "request_rate": self.request_rate,
            "summary": self.summary.as_dict(),
            "validity": self.validity,
            "requests": [
                {**asdict(r), "ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e} for r in self.results
            ],
        }


def write_json(path: Path, config: dict[str, Any], runs: Sequence[RunReport]) -> None:
    """Strict JSON: NaN (a metric with no samples) becomes null, an infinite rate "inf"."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = _strict({"config": config, "runs": [r.as_dict() for r in runs]})
    path.write_text(json.dumps(body, indent=1, allow_nan=False, default=str))


def _strict(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def _ms(d: Distribution) -> str:
    if d.count == 0:
        return "-"
    return f"{d.mean * 1e3:9.1f} {d.median * 1e3:9.1f} {d.p90 * 1e3:9.1f} {d.p99 * 1e3:9.1f}"


def text_summary(run: RunReport) -> str:
    s = run.summary
    lines = [
        f"==== {run.label} " + "=" * max(0, 60 - len(run.label)),
        f"requests: {s.completed} completed, {s.failed} failed in {s.duration_s:.1f} s",
        f"throughput: {s.request_throughput:.3f} req/s, {s.output_throughput:.1f} output tok/s, "
        f"{s.total_token_throughput:.1f} total tok/s",
    ]
    if s.goodput is not None:
        lines.append(f"goodput: {s.goodput:.3f} req/s meeting the SLOs")
    if run.validity is not None:
        v = run.validity
        lines.append(
            f"checked: {v['valid']} of {v['requests']} outputs valid, "
            f"{v['cut_by_max_tokens']} cut by max_tokens, invalid: {v['invalid']}"
        )
    lines.append(f"{'(ms)':6}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        lines.append(f"{name.upper():6}{_ms(getattr(s, name))}")
    if s.cache is not None:
        line = f"prefix cache: {s.cache.hit_rate:.1%} of prompt tokens reused"
        if s.cache.oracle_hit_rate is not None and s.cache.of_oracle is not None:
            line += (
                f" (infinite-cache oracle {s.cache.oracle_hit_rate:.1%}; "
                f"{s.cache.of_oracle:.1%} of it)"
            )
        lines.append(line)
        for turn, d in s.cache.ttft_by_turn.items():
            lines.append(f"{f'TTFT turn {turn + 1}':16}{_ms(d)}")
    for err, count in s.errors.items():
        lines.append(f"error x{count}: {err}")
    return "\n".join(lines)


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values) * 1e3)
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)


def write_png(path: Path, runs: Sequence[RunReport], title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = len(runs) > 1 and all(r.request_rate is not None for r in runs)
    fig, axes = plt.subplots(1, 4 if sweep else 2, figsize=(18 if sweep else 10, 4))
    for run in runs:
        _cdf(axes[0], [r.ttft for r in run.results if r.ttft is not None], run.label)
        _cdf(axes[1], [r.tpot for r in run.results if r.tpot is not None], run.label)
    for ax, name in zip(axes[:2], ("TTFT", "TPOT"), strict=True):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if sweep:
        rates = [float(r.request_rate or 0) for r in runs]
        axes[2].plot(rates, [r.summary.output_throughput for r in runs], marker="o")
        axes[2].set_xlabel("request rate (req/s)")
        axes[2].set_ylabel("output tokens/s")
        axes[2].set_title("throughput")
        for name in ("ttft", "tpot"):
            axes[3].plot(
                rates, [getattr(r.summary, name).p99 * 1e3 for r in runs], marker="o",
                label=f"p99 {name.upper()}",
            )  # fmt: skip
            axes[3].plot(
                rates, [getattr(r.summary, name).median * 1e3 for r in runs], marker=".",
                linestyle="--", label=f"median {name.upper()}",
            )  # fmt: skip
        axes[3].set_xlabel("request rate (req/s)")
        axes[3].set_ylabel("ms")
        axes[3].set_title("latency")
        axes[3].legend(fontsize=7)
        for ax in axes[2:]:
            ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
