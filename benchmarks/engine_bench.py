"""Engine throughput next to transformers, same weights, same process, same thread count.

Prefill tokens/s at several prompt lengths and decode tokens/s at several batch
sizes (context 512), for each dtype and thread count. Every figure is the
median of ``--repeats`` runs, and each of ours is printed as a time ratio to
transformers measured right beside it (ratio < 1.0: we are faster).

Batch scaling (decode throughput at batch 32 over batch 1) is measured the same
way: two engines on the same weights, one decoding 1 sequence and one 32,
their windows alternated, so the ratio is not skewed by the machine's noise
drifting between the two batch sizes' runs.

    python -m benchmarks.engine_bench --out bench-results/engine.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.results import save_json
from shared.config import CacheConfig, EngineConfig, HugePages, SchedulerConfig, default_cache_dir
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel, load_model


def paired(a: Callable[[], float], b: Callable[[], float], repeats: int) -> tuple[float, float]:
    """Median times of ``a`` and ``b`` run alternately (ABAB...), after one warm-up each.

    Alternating spreads the machine's noise over both sides of the ratio.
    """
    a()
    b()
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(a())
        tb.append(b())
    return statistics.median(ta), statistics.median(tb)


def prompt_ids(n: int, salt: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + salt)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


class Ours:
    def __init__(self, loaded: LoadedModel, dtype: str, huge_pages: HugePages = "auto"):
        cfg = EngineConfig(
            dtype=dtype,  # type: ignore[arg-type]
            cache=CacheConfig(
                kv_cache_bytes=2 << 30, enable_prefix_caching=False, huge_pages=huge_pages
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=128),
        )
        self.engine = Engine(loaded, cfg)
        self.vocab = loaded.arch.vocab_size
        self._salt = 0

    def _fresh(self, n: int) -> list[int]:
        self._salt += 1
        return prompt_ids(n, self._salt, self.vocab)

    def prefill(self, n: int) -> float:
        self.engine.add_request(
            self._fresh(n), SamplingParams(max_tokens=1, temperature=0), detokenize=False
        )
        t0 = time.perf_counter()
        while self.engine.has_unfinished():
            self.engine.step()
        return time.perf_counter() - t0

    def start_decode(self, batch: int, ctx: int, total_steps: int) -> None:
        """Prefill ``batch`` sequences of ``ctx`` tokens that then decode ``total_steps`` tokens."""
        params = SamplingParams(max_tokens=total_steps + 1, temperature=0, ignore_eos=True)
        rids = [
            self.engine.add_request(self._fresh(ctx), params, detokenize=False)
            for _ in range(batch)
        ]
        started: set[str] = set()
        while len(started) < len(rids):
            started.update(o.request_id for o in self.engine.step())

    def decode_window(self, steps: int, warmup: int = 0) -> float:
        """Time ``steps`` engine steps after ``warmup`` untimed ones."""
        for _ in range(warmup):
            self.engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        return time.perf_counter() - t0

    def end_decode(self) -> None:
        if self.engine.has_unfinished():
            raise RuntimeError("decode benchmark left requests running")


class Transformers:
    def __init__(self, folder: Path, dtype: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=getattr(torch, dtype)
        ).eval()
        self.vocab = self.model.config.vocab_size
        self._salt = 10_000
        self._past: Any = None
        self._next = torch.empty(0)

    def _fresh(self, n: int, batch: int = 1) -> torch.Tensor:
        rows = []
        for _ in range(batch):
            self._salt += 1
            rows.append(prompt_ids(n, self._salt, self.vocab))
        return torch.tensor(rows)

    @torch.inference_mode()
    def prefill(self, n: int) -> float:
        ids = self._fresh(n)
        t0 = time.perf_counter()
        out = self.model(ids, use_cache=True, logits_to_keep=1)
        out.logits[:, -1].argmax(-1)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def start_decode(self, batch: int, ctx: int, total_steps: int) -> None:
        out = self.model(self._fresh(ctx, batch), use_cache=True, logits_to_keep=1)
        self._past = out.past_key_values
        self._next = out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def decode_window(self, steps: int) -> float:
        """The loop inside ``generate`` (greedy, KV cache), without its per-call overhead."""
        t0 = time.perf_counter()
        for _ in range(steps):
            out = self.model(self._next, past_key_values=self._past, use_cache=True)
            self._past = out.past_key_values
            self._next = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - t0

    def end_decode(self) -> None:
        self._past = None


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    for dtype in args.dtypes:
        results.extend(run_dtype(args, dtype))
    return {
        "config": {k: str(v) for k, v in vars(args).items()},
        "results": results,
        "summary": _summary(results),
    }


def run_dtype(args: argparse.Namespace, dtype: str) -> list[dict[str, Any]]:
    loaded = load_model(None, cache_dir=args.cache_dir, dtype=dtype, progress=False)
    ours = Ours(loaded, dtype)
    ref = Transformers(loaded.folder, dtype)
    rows: list[dict[str, Any]] = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n in args.prefill:
            t_ours, t_ref = paired(partial(ours.prefill, n), partial(ref.prefill, n), args.repeats)
            rows.append(_row("prefill", dtype, threads, n, n, t_ours, t_ref))
            _print(rows[-1])
        for b in args.batch:
            total = args.steps * (args.repeats + 1)
            ours.start_decode(b, args.ctx, total)
            ref.start_decode(b, args.ctx, total)
            t_ours, t_ref = paired(
                partial(ours.decode_window, args.steps),
                partial(ref.decode_window, args.steps),
                args.repeats,
            )
            ours.end_decode()
            ref.end_decode()
            rows.append(_row("decode", dtype, threads, b, b * args.steps, t_ours, t_ref))
            _print(rows[-1])
        if 1 in args.batch and SCALING_BATCH in args.batch:
            rows.append(scaling(loaded, dtype, threads, args))
            print(
                f"scaling {dtype:8s} threads={threads} batch {SCALING_BATCH} over batch 1, "
                f"paired: {rows[-1]['batch32_over_batch1']:.2f}x",
                flush=True,
            )
    return rows


SCALING_BATCH = 32


def scaling(
    loaded: LoadedModel, dtype: str, threads: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Decode throughput at batch 32 over batch 1, from alternated windows of two engines."""
    one, many = Ours(loaded, dtype), Ours(loaded, dtype)
    # each window starts with untimed steps of its own batch size, so that neither is
    # timed in the wake of the other (a batch-1 window right after batch-32 GEMMs ran
    # up to 30% slower here, which would flatter the ratio)
    warmup = max(2, args.steps // 4)
    total = (args.steps + warmup) * (args.repeats + 1)
    one.start_decode(1, args.ctx, total)
    many.start_decode(SCALING_BATCH, args.ctx, total)
    t_many, t_one = paired(
        partial(many.decode_window, args.steps, warmup),
        partial(one.decode_window, args.steps, warmup),
        args.repeats,
    )
    one.end_decode()
    many.end_decode()
    return {
        "kind": "scaling",
        "dtype": dtype,
        "threads": threads,
        "batch1_tok_s": args.steps / t_one,
        "batch32_tok_s": SCALING_BATCH * args.steps / t_many,
        "batch32_over_batch1": SCALING_BATCH * t_one / t_many,
    }


def _row(
    kind: str, dtype: str, threads: int, size: int, tokens: int, t_ours: float, t_ref: float
) -> dict[str, Any]:
    return {
        "kind": kind,
        "dtype": dtype,
        "threads": threads,
        "size": size,
        "ours_tok_s": tokens / t_ours,
        "transformers_tok_s": tokens / t_ref,
        "time_ratio": t_ours / t_ref,
    }


def _print(r: dict[str, Any]) -> None:
    label = "prompt" if r["kind"] == "prefill" else "batch"
    print(
        f"{r['kind']:7s} {r['dtype']:8s} threads={r['threads']} {label}={r['size']:<5d} "
        f"ours {r['ours_tok_s']:8.1f} tok/s  transformers {r['transformers_tok_s']:8.1f} tok/s  "
        f"time ratio {r['time_ratio']:.2f}",
        flush=True,
    )


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Batch-32 over batch-1 decode throughput per dtype and thread count: the paired
    measurement where one ran, else the ratio of the two separate decode rows."""
    out: dict[str, Any] = {}
    for dtype in sorted({r["dtype"] for r in results}):
        for threads in sorted({r["threads"] for r in results}):
            mine = [r for r in results if r["dtype"] == dtype and r["threads"] == threads]
            dec = {r["size"]: r["ours_tok_s"] for r in mine if r["kind"] == "decode"}
            paired_rows = [r for r in mine if r["kind"] == "scaling"]
            key = f"{dtype}/t{threads}/batch32_over_batch1"
            if paired_rows:
                out[key] = paired_rows[-1]["batch32_over_batch1"]
            elif 1 in dec and SCALING_BATCH in dec:
                out[key] = dec[SCALING_BATCH] / dec[1]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--prefill", nargs="*", type=int, default=[128, 512, 1024, 2048])
    p.add_argument("--batch", nargs="*", type=int, default=[1, 8, 32, 64])
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    report = run(args)
    print(json.dumps(report["summary"], indent=2))
    save_json(args.out, report)


if __name__ == "__main__":
    main()
