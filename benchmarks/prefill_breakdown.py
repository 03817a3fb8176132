"""Where a prefill's time goes, and how close each part runs to this core's peak.

The engine prefills fresh prompts (one at a time, nothing cached, the first token
sampled) with timing wrappers around its weight GEMMs and its prefill attention;
the rest of the forward (norms, RoPE, activations, K/V writes, the embedding) and
the engine around it are what is left. GEMM and attention report GFLOP/s (the
GEMMs' FLOPs counted from the shapes they ran, the LM head on the rows it was
asked for; attention's causal work) and their share of the peak measured on this
core (``benchmarks/peak.py``) times the thread count. Medians over ``--repeats``.

    python -m benchmarks.prefill_breakdown --threads 1 2 --prompts 512 2048
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_bench import Ours
from benchmarks.peak import core_peak
from benchmarks.results import save_json
from benchmarks.step_breakdown import Clock, TimedLinear
from shared.config import default_cache_dir, resolve_dtype
from shared.kernels.gemm import Glu
from shared.model.attention import PrefillSegment
from shared.model.attention_impl import AttentionImpl
from shared.model.linear import Linear, PackedWeight
from shared.model.loader import load_model
from shared.model.pointwise import Pointwise
from shared.model.prefill_attention import PrefillAttention


class CountedLinear(TimedLinear):
    """Times each GEMM and counts its FLOPs (2 * rows * in * out)."""

    def __init__(self, inner: Linear, clock: Clock):
        super().__init__(inner, clock)
        self.flops = 0.0

    def __call__(self, x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
        out = super().__call__(x, packed)
        self.flops += 2.0 * x.shape[0] * x.shape[-1] * out.shape[-1]
        return out

    def glu(self, x: torch.Tensor, packed: PackedWeight, act: Glu, ops: Pointwise) -> torch.Tensor:
        out = super().glu(x, packed, act, ops)
        self.flops += 2.0 * x.shape[0] * x.shape[-1] * packed.out_features
        return out


class CountedPrefill(PrefillAttention):
    """Times each prefill attention call and counts its causal FLOPs."""

    def __init__(self, inner: PrefillAttention, clock: Clock):
        self.inner, self.clock, self.name = inner, clock, inner.name
        self.flops = 0.0

    def __call__(
        self,
        q: torch.Tensor,
        new_k: torch.Tensor,
        new_v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        seg: PrefillSegment,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        n, heads, head_dim = q.shape
        self.flops += 4.0 * heads * head_dim * attended_pairs(n, seg.context_len, window)
        out: torch.Tensor = self.clock.timed(
            "attention", self.inner, q, new_k, new_v, k_pool, v_pool, seg, scale, window
        )
        return out


def attended_pairs(n: int, context_len: int, window: int | None) -> int:
    """Query-key pairs the newest ``n`` of ``context_len`` tokens attend (causal; each
    over its ``window`` newest keys only, where a window is set)."""
    prefix = context_len - n
    if window is None:
        return n * prefix + n * (n + 1) // 2
    return sum(min(prefix + i + 1, window) for i in range(n))


def measure(
    ours: Ours, clock: Clock, gemm: CountedLinear, attn: CountedPrefill, n: int, repeats: int
) -> dict[str, float]:
    ours.prefill(n)  # warm-up at this length
    rows = []
    for _ in range(repeats):
        clock.reset()
        gemm.flops = attn.flops = 0.0
        total = ours.prefill(n)
        rows.append({"total": total, **clock.spent, "gemm_flops": gemm.flops,
                     "attention_flops": attn.flops})  # fmt: skip
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model name or path (default: the default)")
    p.add_argument("--dtype", default="auto", help="as baton up takes it (auto: the host's)")
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--prompts", nargs="+", type=int, default=[512, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--linear", default="auto", help="the GEMM backend (BATON_LINEAR's values)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.dtype = resolve_dtype(args.dtype, "cpu")
    peak = core_peak(args.dtype, threads=args.threads)
    loaded = load_model(
        args.model, cache_dir=default_cache_dir(), dtype=args.dtype, progress=False,
        linear=args.linear,
    )  # fmt: skip
    backend = loaded.model.gemm.name
    clock = Clock()
    gemm = CountedLinear(loaded.model.gemm, clock)
    loaded.model.gemm = gemm
    ours = Ours(loaded, args.dtype)
    runner = ours.engine.runner
    attn = CountedPrefill(runner.attention.prefill, clock)
    runner.attention = AttentionImpl(runner.attention.decode, attn)
    forward = loaded.model.forward
    loaded.model.forward = lambda *a: clock.timed("forward", forward, *a)  # type: ignore[method-assign]
    print(f"peak ({args.dtype}): " + (peak.describe() if peak else "unknown"))
    results: list[dict[str, Any]] = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n in args.prompts:
            m = measure(ours, clock, gemm, attn, n, args.repeats)
            row: dict[str, Any] = {
                "dtype": args.dtype, "gemm": backend, "threads": threads,
                "prompt": n,
                "total_ms": m["total"] * 1e3, "gemm_ms": m["gemm"] * 1e3,
                "attention_ms": m["attention"] * 1e3,
                "rest_of_forward_ms": (m["forward"] - m["gemm"] - m["attention"]) * 1e3,
                "outside_forward_ms": (m["total"] - m["forward"]) * 1e3,
                "gemm_gflops": m["gemm_flops"] / m["gemm"] / 1e9,
                "attention_gflops": m["attention_flops"] / m["attention"] / 1e9,
                "peak_gflops_per_core": peak.gflops_per_core if peak else None,
                "peak_unit": peak.unit if peak else None,
            }  # fmt: skip
            share = ""
            if peak:
                row["gemm_share_of_peak"] = peak.share(row["gemm_gflops"], threads)
                row["attention_share_of_peak"] = peak.share(row["attention_gflops"], threads)
                share = (
                    f" [{row['gemm_share_of_peak']:.0%} / {row['attention_share_of_peak']:.0%}"
                    " of peak]"
                )
            results.append(row)
            print(
                f"{args.dtype} {backend} threads={threads} prompt={n:<5d} "
                f"{row['total_ms']:7.1f} ms: "
                f"GEMM {row['gemm_ms']:6.1f} ms ({row['gemm_gflops']:4.0f} GFLOP/s), "
                f"attention {row['attention_ms']:6.1f} ms ({row['attention_gflops']:4.0f} "
                f"GFLOP/s), rest of forward {row['rest_of_forward_ms']:5.1f}, outside forward "
                f"{row['outside_forward_ms']:5.1f}{share}",
                flush=True,
            )
    save_json(args.out, results)


if __name__ == "__main__":
    main()
