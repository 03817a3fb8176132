"""Prefill attention alone: the native kernel next to torch SDPA, same inputs, same run.

One layer of the default model's shape (9 query heads, 3 KV heads, head_dim
64) over a paged pool whose blocks are shuffled as an engine's are. Each case
times both implementations alternately (ABAB...) and prints the median times
and their ratio (< 1.0: the kernel is faster). Cases: fresh prompts of several
lengths, and a chunk on top of a cached prefix (SDPA then needs the context
gathered from the pool first, as the engine's SDPA path does).

    python -m benchmarks.attention_bench --out bench-results/attention.json
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.engine_bench import paired
from benchmarks.results import save_json
from shared.config import default_cache_dir
from shared.kernels.paged_prefill import PagedPrefillKernel
from shared.model.attention import PrefillSegment
from shared.model.prefill_attention import NativePrefill, PrefillAttention, SdpaPrefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# q, new K, new V, K pool, V pool, segment: a PrefillAttention call's arguments
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PrefillSegment]


def make_inputs(new: int, context: int, dtype: torch.dtype, seed: int = 0) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context // BLOCK)
    pool = torch.randn(blocks + 8, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    table = torch.randperm(blocks + 8, generator=g)[:blocks].contiguous()
    k_pool, v_pool = pool[:, 0], pool[:, 1]
    q = torch.randn(new, HEADS, HEAD_DIM, generator=g).to(dtype)
    k_ctx = k_pool[table].reshape(-1, KV_HEADS, HEAD_DIM)[:context]
    v_ctx = v_pool[table].reshape(-1, KV_HEADS, HEAD_DIM)[:context]
    seg = PrefillSegment(start=0, end=new, block_table=table, context_len=context)
    return q, k_ctx[-new:], v_ctx[-new:], k_pool, v_pool, seg


def timed(impl: PrefillAttention, args: Inputs, scale: float, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        impl(*args, scale)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--prompts", nargs="+", type=int, default=[128, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    kernel = PagedPrefillKernel.build(default_cache_dir() / "kernels")
    native, sdpa = NativePrefill(kernel), SdpaPrefill()
    # (new tokens, context): fresh prompts, then a 512-token chunk on a cached prefix
    cases = [(n, n) for n in args.prompts] + [(512, 2048)]
    results = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for new, context in cases:
                inputs = make_inputs(new, context, dtype)
                reps = max(1, 2048 // new)
                t_native, t_sdpa = paired(
                    partial(timed, native, inputs, HEAD_DIM**-0.5, reps),
                    partial(timed, sdpa, inputs, HEAD_DIM**-0.5, reps),
                    args.repeats,
                )
                row = {
                    "dtype": dtype_name,
                    "threads": threads,
                    "new_tokens": new,
                    "context": context,
                    "native_ms": t_native * 1e3,
                    "sdpa_ms": t_sdpa * 1e3,
                    "time_ratio": t_native / t_sdpa,
                }
                results.append(row)
                print(
                    f"prefill attention {dtype_name:8s} threads={threads} new={new:<5d} "
                    f"context={context:<5d} native {row['native_ms']:7.2f} ms  "
                    f"sdpa {row['sdpa_ms']:7.2f} ms  time ratio {row['time_ratio']:.2f}",
                    flush=True,
                )
    save_json(args.out, results)


if __name__ == "__main__":
    main()
