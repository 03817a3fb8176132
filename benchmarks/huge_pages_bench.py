"""Decode steps with the KV pool on 4 KB pages next to reserved 2 MB huge pages.

Two engines on the same weights, one per page size, prefill the same kind of
batch (context 512) and then alternate 16-step decode windows; printed are
median and best step times per batch size and their ratio (< 1.0: huge pages
faster). Needs 2 MB pages the host reserved for one 2 GiB pool
(``sysctl vm.nr_hugepages=1100`` or more).

    python -m benchmarks.huge_pages_bench --dtype float32 --threads 1 --batch 1 32
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.decode_args import decode_parser, load_default_model
from benchmarks.engine_bench import Ours
from benchmarks.results import save_json
from shared.model.loader import LoadedModel


def measure(loaded: LoadedModel, args: argparse.Namespace, batch: int) -> dict[str, object]:
    """One batch size; the two engines (and their pools) are freed on return."""
    # "on": a clear error rather than a silent comparison of 4 KB pages with themselves
    engines = (Ours(loaded, args.dtype, "off"), Ours(loaded, args.dtype, "on"))
    for engine in engines:
        engine.start_decode(batch, args.ctx, 16 * (args.repeats + 2))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(args.repeats):
        for engine, out in zip(engines, times, strict=True):
            out.append(engine.decode_window(16, warmup=1) / 16)
    small, huge = statistics.median(times[0]), statistics.median(times[1])
    return {
        "dtype": args.dtype,
        "threads": args.threads,
        "batch": batch,
        "small_pages_ms": small * 1e3,
        "huge_pages_ms": huge * 1e3,
        "small_pages_best_ms": min(times[0]) * 1e3,
        "huge_pages_best_ms": min(times[1]) * 1e3,
        "time_ratio": huge / small,
    }


def main() -> None:
    args = decode_parser(__doc__, repeats=10).parse_args()
    loaded = load_default_model(args)
    results = []
    for batch in args.batch:
        row = measure(loaded, args, batch)
        results.append(row)
        print(
            f"decode {args.dtype} threads={args.threads} batch={batch:<3d} step: "
            f"4 KB pages {row['small_pages_ms']:6.1f} ms (best {row['small_pages_best_ms']:.1f})  "
            f"2 MB pages {row['huge_pages_ms']:6.1f} ms (best {row['huge_pages_best_ms']:.1f})  "
            f"time ratio {row['time_ratio']:.2f}",
            flush=True,
        )
    save_json(args.out, results)


if __name__ == "__main__":
    main()
