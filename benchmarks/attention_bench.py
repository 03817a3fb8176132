"""Prefill attention alone: the native kernel next to torch SDPA, same inputs, same run.

One layer of the default model's shape (9 query heads, 3 KV heads, head_dim
64) over a paged pool whose blocks are shuffled as an engine's are. Each case
times both implementations alternately (ABAB...) and prints the median times
and their ratio (< 1.0: the kernel is faster). Cases: fresh prompts of several
lengths, and a chunk on top of a cached prefix (SDPA then needs the context
gathered from the pool first, as the engine's SDPA path does). GFLOP/s count
the causal work (4 * heads * head_dim per query-key pair attended); beside them,
their share of this core's peak (``benchmarks/peak.py``) times the thread count.

``--against REV`` also builds the kernel as it was at git revision REV (its
``shared/kernels`` sources) and times it in the same rounds, for a before/after
ratio measured side by side; with ``--decode-batch`` the decode kernel (the same
tile, one token per sequence) is timed against REV's too, at each batch size over
contexts of 512 and 2,048 tokens (decode has no SDPA twin here).

    python -m benchmarks.attention_bench --against HEAD~1 --out bench-results/attention.json

``--geometry gemma3-local`` times Gemma 3's shape instead (4 query heads on 1 KV head,
head_dim 256) with its 512-token sliding window (SDPA then gets the window as a mask;
GFLOP/s count only the keys each row reads); ``gemma3-global`` the same without it.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from benchmarks.engine_bench import paired
from benchmarks.peak import core_peak, share_text
from benchmarks.results import save_json
from shared.config import default_cache_dir
from shared.kernels.build import build_library
from shared.kernels.paged_decode import PagedDecodeKernel
from shared.kernels.paged_prefill import PagedPrefillKernel
from shared.model.attention import DecodeBatch, PrefillSegment
from shared.model.prefill_attention import NativePrefill, PrefillAttention, SdpaPrefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


@dataclass(frozen=True)
class Geometry:
    """One layer's attention shape (and window) as a model has it."""

    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None

    @property
    def scale(self) -> float:
        return float(self.head_dim**-0.5)


GEOMETRIES = {
    "smollm2": Geometry(HEADS, KV_HEADS, HEAD_DIM),
    "gemma3-local": Geometry(4, 1, 256, 512),
    "gemma3-global": Geometry(4, 1, 256),
}
DEFAULT = GEOMETRIES["smollm2"]
# q, new K, new V, K pool, V pool, segment: a PrefillAttention call's arguments
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PrefillSegment]


def make_inputs(
    new: int, context: int, dtype: torch.dtype, seed: int = 0, geo: Geometry = DEFAULT
) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context // BLOCK)
    pool = torch.randn(blocks + 8, 2, BLOCK, geo.kv_heads, geo.head_dim, generator=g).to(dtype)
    table = torch.randperm(blocks + 8, generator=g)[:blocks].contiguous()
    k_pool, v_pool = pool[:, 0], pool[:, 1]
    q = torch.randn(new, geo.heads, geo.head_dim, generator=g).to(dtype)
    k_ctx = k_pool[table].reshape(-1, geo.kv_heads, geo.head_dim)[:context]
    v_ctx = v_pool[table].reshape(-1, geo.kv_heads, geo.head_dim)[:context]
    seg = PrefillSegment(start=0, end=new, block_table=table, context_len=context)
    return q, k_ctx[-new:], v_ctx[-new:], k_pool, v_pool, seg


def flops(new: int, context: int, geo: Geometry = DEFAULT) -> float:
    """Causal attention work of ``new`` rows on top of ``context - new`` cached tokens
    (each over its window's keys only, where the geometry has one)."""
    window = geo.window or context
    pairs = sum(min(context - new + i + 1, window) for i in range(new))
    return 4.0 * geo.heads * geo.head_dim * pairs


def library_at(rev: str, out_dir: Path) -> Path:
    """The attention library compiled from git revision ``rev``'s sources."""
    src = out_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "shared/kernels/"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in names:
        if name.endswith((".c", ".h")):
            text = subprocess.run(
                ["git", "show", f"{rev}:{name}"], check=True, capture_output=True, text=True
            ).stdout
            (src / Path(name).name).write_text(text)
    if "int64_t window" not in (src / "paged_decode.c").read_text():
        # the entry points gained a window argument (commit 4c4fff2): an older library
        # would read the thread count from it
        raise SystemExit(f"--against {rev}: its kernels predate the window argument")
    return build_library(src / "paged_decode.c", out_dir)


DecodeInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeBatch]


def make_decode_inputs(batch: int, context: int, dtype: torch.dtype) -> DecodeInputs:
    """``batch`` sequences of ``context`` tokens, their blocks shuffled through one pool."""
    g = torch.Generator().manual_seed(1)
    blocks = -(-context // BLOCK)
    pool = torch.randn(batch * blocks + 8, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    order = torch.randperm(batch * blocks + 8, generator=g)[: batch * blocks].view(batch, blocks)
    tables = DecodeBatch.build(order.tolist(), [context] * batch, BLOCK, "cpu")
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, pool[:, 0], pool[:, 1], tables


def timed_decode(kernel: PagedDecodeKernel, args: DecodeInputs, reps: int) -> float:
    q, k_pool, v_pool, batch = args
    out = torch.empty_like(q)
    t0 = time.perf_counter()
    for _ in range(reps):
        kernel(q, k_pool, v_pool, batch.tables, batch.lens, HEAD_DIM**-0.5, out)
    return (time.perf_counter() - t0) / reps


def decode_rows(
    now: PagedDecodeKernel, then: PagedDecodeKernel, rev: str, args: argparse.Namespace
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        peak = core_peak(dtype_name, threads=args.threads)
        print(f"peak ({dtype_name}): " + (peak.describe() if peak else "unknown"))
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.decode_batch:
                for context in (512, 2048):
                    inputs = make_decode_inputs(batch, context, dtype)
                    reps = max(1, 4096 // (batch * context // 64))
                    t_then, t_now = paired(
                        partial(timed_decode, then, inputs, reps),
                        partial(timed_decode, now, inputs, reps),
                        args.repeats,
                    )
                    rows.append({
                        "kind": "decode", "dtype": dtype_name, "threads": threads,
                        "batch": batch, "context": context, "native_ms": t_now * 1e3,
                        "before_ms": t_then * 1e3, "against": rev,
                        "time_vs_before": t_now / t_then,
                    })  # fmt: skip
                    print(
                        f"decode attention  {dtype_name:8s} threads={threads} batch={batch:<3d} "
                        f"context={context:<5d} native {t_now * 1e3:7.3f} ms  {rev} "
                        f"{t_then * 1e3:7.3f} ms (now/then {t_now / t_then:.2f})",
                        flush=True,
                    )
    return rows


def timed(impl: PrefillAttention, args: Inputs, geo: Geometry, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        impl(*args, geo.scale, geo.window)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--prompts", nargs="+", type=int, default=[128, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--against", metavar="REV", default=None, help="git revision to compare")
    p.add_argument(
        "--decode-batch", nargs="*", type=int, default=[],
        help="also time decode at these batch sizes against REV",
    )  # fmt: skip
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="smollm2")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    geo = GEOMETRIES[args.geometry]
    kernel = PagedPrefillKernel.build(default_cache_dir() / "kernels")
    native, sdpa = NativePrefill(kernel), SdpaPrefill()
    before = None
    results: list[dict[str, object]] = []
    if args.against:
        old_library = library_at(args.against, Path(tempfile.mkdtemp(prefix="attn-")))
        before = NativePrefill(PagedPrefillKernel(old_library))
        if args.decode_batch:
            now = PagedDecodeKernel.build(default_cache_dir() / "kernels")
            results += decode_rows(now, PagedDecodeKernel(old_library), args.against, args)
    # (new tokens, context): fresh prompts, then a 512-token chunk on a cached prefix
    cases = [(n, n) for n in args.prompts] + [(512, 2048)]
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        peak = core_peak(dtype_name, threads=args.threads)
        print(f"peak ({dtype_name}): " + (peak.describe() if peak else "unknown"))
        for threads in args.threads:
            torch.set_num_threads(threads)
            for new, context in cases:
                inputs = make_inputs(new, context, dtype, geo=geo)
                reps = max(1, 2048 // new)
                t_native, t_sdpa = paired(
                    partial(timed, native, inputs, geo, reps),
                    partial(timed, sdpa, inputs, geo, reps),
                    args.repeats,
                )
                t_before = None
                if before is not None:
                    t_before, t_native = paired(
                        partial(timed, before, inputs, geo, reps),
                        partial(timed, native, inputs, geo, reps),
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
                    "native_gflops": flops(new, context, geo) / t_native / 1e9,
                    "sdpa_gflops": flops(new, context, geo) / t_sdpa / 1e9,
                    "geometry": args.geometry,
                }
                if peak is not None:
                    row["native_share_of_peak"] = peak.share(row["native_gflops"], threads)
                    row["sdpa_share_of_peak"] = peak.share(row["sdpa_gflops"], threads)
                native_share = share_text(peak, row["native_gflops"], threads)
                sdpa_share = share_text(peak, row["sdpa_gflops"], threads)
                line = (
                    f"prefill attention {dtype_name:8s} threads={threads} new={new:<5d} "
                    f"context={context:<5d} native {row['native_ms']:7.2f} ms "
                    f"({row['native_gflops']:5.1f} GFLOP/s{native_share})  sdpa "
                    f"{row['sdpa_ms']:7.2f} ms ({row['sdpa_gflops']:5.1f}{sdpa_share})  "
                    f"time ratio {row['time_ratio']:.2f}"
                )
                if t_before is not None:
                    row["before_ms"] = t_before * 1e3
                    row["against"] = args.against
                    row["time_vs_before"] = t_native / t_before
                    then = f"{args.against} {t_before * 1e3:7.2f} ms"
                    line += f"  {then} (now/then {t_native / t_before:.2f})"
                results.append(row)
                print(line, flush=True)
    save_json(args.out, results)


if __name__ == "__main__":
    main()
