"""The mixed pool against fixed splits with the same number of instances.

Each fixed split (``baton up --prefill P --decode D``) and each mixed pool
(``baton up --prefill P --decode D --mixed``: the same instances, each able to
serve the other role when the gateway lends it) serves the same requests of a
trace (``baton bench``'s replay: the same scaling, arrivals and lengths); goodput
counts requests that met both SLOs. Printed: each deployment's goodput, TTFT and
TPOT, and the best mixed pool's goodput over the best fixed split's.

    python -m benchmarks.mixed_bench \\
        --trace ../shared/workloads/azure-2023/AzureLLMInferenceTrace_conv.csv \\
        --num-requests 60 --time-scale 1 --token-scale 0.5 --slo-ttft 3 --slo-tpot 0.1 \\
        --fixed 2:1 1:2 --mixed 2:1 1:2
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.plan_check import add_trace_arguments, measure_split


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_trace_arguments(p)
    p.add_argument("--fixed", nargs="+", default=["2:1", "1:2"], help="P:D splits")
    p.add_argument("--mixed", nargs="+", default=["2:1", "1:2"], help="P:D home roles")
    p.add_argument("--extra", default="", help="further `baton up` arguments for every run")
    p.add_argument("--out", type=Path, default=Path("bench-results/mixed"))
    return p.parse_args(argv)


def split(text: str) -> tuple[int, int]:
    p, d = (int(x) for x in text.split(":"))
    return p, d


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    extra = args.extra.split()
    runs = [(s, False) for s in args.fixed] + [(s, True) for s in args.mixed]
    rows: list[dict[str, Any]] = []
    for text, mixed in runs:
        p, d = split(text)
        label = " mixed" if mixed else ""
        figures = measure_split(args, p, d, [*extra, *(["--mixed"] if mixed else [])], label)
        rows.append({"deployment": f"{p}P:{d}D{label}", "mixed": mixed, **figures})
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "mixed.json").write_text(json.dumps(rows, indent=1))
    fixed = max((r for r in rows if not r["mixed"]), key=lambda r: r["goodput"], default=None)
    best = max((r for r in rows if r["mixed"]), key=lambda r: r["goodput"], default=None)
    if fixed and best and fixed["goodput"] > 0:
        ratio = best["goodput"] / fixed["goodput"]
        print(f"best mixed {best['deployment']} / best fixed {fixed['deployment']}: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
