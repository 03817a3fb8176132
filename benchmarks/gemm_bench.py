"""Weight GEMMs alone: the native kernel next to oneDNN over one forward's weights.

The default model's GEMM shapes (30 layers of fused QKV, O, fused gate/up and
down, then the LM head), each layer with its own random weights, so the
weights are cold as in the engine (about 538 MB in fp32; the caches hold a
few layers). For each row count (the decode batch, or the prompt length in
prefill) both backends run the whole forward's GEMMs alternately (ABAB...);
printed are median times, GFLOPS with their share of this core's peak
(``benchmarks/peak.py``) times the thread count, and the time ratio (< 1.0:
native faster), for the whole forward and then per shape (each layer GEMM over
the 30 layers; the LM head, which a prefill runs on its last row only, apart).

    python -m benchmarks.gemm_bench --out bench-results/gemm.json
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_bench import paired
from benchmarks.peak import Peak, core_peak, share_text
from benchmarks.results import save_json
from shared.config import default_cache_dir
from shared.model.linear import Linear, NativeLinear, OneDNNLinear, PackedWeight

# SmolLM2-135M: hidden 576, 9 heads + 2 x 3 KV heads of 64, intermediate 1536
LAYER_SHAPES = {
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
}
LAYERS = 30
LM_HEAD = (49152, 576)


def forward_weights(linear: Linear, dtype: torch.dtype, layers: int) -> list[PackedWeight]:
    """One forward's weights in call order, packed by ``linear``."""
    g = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(layers) for s in LAYER_SHAPES.values()] + [LM_HEAD]
    return [linear.pack((torch.randn(*s, generator=g) * 0.02).to(dtype)) for s in shapes]


def activations(
    weights: list[PackedWeight], rows: int, dtype: torch.dtype
) -> dict[int, torch.Tensor]:
    """One input per distinct ``in_features``."""
    g = torch.Generator().manual_seed(rows)
    ks = {w.in_features for w in weights}
    return {k: torch.randn(rows, k, generator=g).to(dtype) for k in ks}


def run_forward(linear: Linear, weights: list[PackedWeight], xs: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for w in weights:
        linear(xs[w.in_features], w)
    return time.perf_counter() - t0


def shape_names(layers: int) -> list[str]:
    """The shape of each weight :func:`forward_weights` returns, in its order."""
    return [name for _ in range(layers) for name in LAYER_SHAPES] + ["lm_head"]


def forward_flops(rows: int, layers: int) -> int:
    per_layer = sum(n * k for n, k in LAYER_SHAPES.values())
    return 2 * rows * (layers * per_layer + LM_HEAD[0] * LM_HEAD[1])


def timings(t_native: float, t_onednn: float, flops: int, peak: Peak | None) -> dict[str, float]:
    """Both sides' times (s) as ms, GFLOPS, their shares of this core's peak times the
    thread count, and their time ratio (< 1.0: native faster)."""
    out = {
        "native_ms": t_native * 1e3,
        "onednn_ms": t_onednn * 1e3,
        "native_gflops": flops / t_native / 1e9,
        "onednn_gflops": flops / t_onednn / 1e9,
        "time_ratio": t_native / t_onednn,
    }
    if peak is not None:
        threads = torch.get_num_threads()
        out["native_share_of_peak"] = peak.share(out["native_gflops"], threads)
        out["onednn_share_of_peak"] = peak.share(out["onednn_gflops"], threads)
    return out


def gflops_text(t: dict[str, float], side: str, peak: Peak | None, width: int) -> str:
    """`` 2423 GFLOPS 32% of peak`` for ``side`` (native, onednn) of ``timings``."""
    rate = t[f"{side}_gflops"]
    return f"{rate:{width}.0f} GFLOPS{share_text(peak, rate, torch.get_num_threads())}"


def per_shape(
    native: Linear,
    ours: list[PackedWeight],
    onednn: Linear,
    theirs: list[PackedWeight],
    xs: dict[int, torch.Tensor],
    args: argparse.Namespace,
    rows: int,
    peak: Peak | None,
) -> dict[str, dict[str, float]]:
    """Each shape's GEMMs alone (its weights across the layers), both backends alternately."""
    names = shape_names(args.layers)
    out: dict[str, dict[str, float]] = {}
    for name in [*LAYER_SHAPES, "lm_head"]:
        mine = [w for w, n in zip(ours, names, strict=True) if n == name]
        other = [w for w, n in zip(theirs, names, strict=True) if n == name]
        t_native, t_onednn = paired(
            partial(run_forward, native, mine, xs),
            partial(run_forward, onednn, other, xs),
            args.repeats,
        )
        n, k = LM_HEAD if name == "lm_head" else LAYER_SHAPES[name]
        out[name] = t = timings(t_native, t_onednn, 2 * rows * n * k * len(mine), peak)
        print(
            f"    {name:8s} native {gflops_text(t, 'native', peak, 5)}  oneDNN "
            f"{gflops_text(t, 'onednn', peak, 5)}  time ratio {t['time_ratio']:.2f}",
            flush=True,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 64, 512])
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    onednn = OneDNNLinear()
    results = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        native = NativeLinear.load(dtype, default_cache_dir() / "kernels")
        problem = native if isinstance(native, str) else OneDNNLinear.probe(dtype)
        if not isinstance(native, NativeLinear) or problem is not None:
            print(f"skipping {dtype_name}: {problem}")
            continue
        peak = core_peak(dtype_name, threads=args.threads)
        print(f"peak ({dtype_name}): " + (peak.describe() if peak else "unknown"))
        ours, theirs = (
            forward_weights(native, dtype, args.layers),
            forward_weights(onednn, dtype, args.layers),
        )
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                xs = activations(ours, rows, dtype)
                t_native, t_onednn = paired(
                    partial(run_forward, native, ours, xs),
                    partial(run_forward, onednn, theirs, xs),
                    args.repeats,
                )
                row: dict[str, Any] = {
                    "dtype": dtype_name,
                    "threads": threads,
                    "rows": rows,
                    **timings(t_native, t_onednn, forward_flops(rows, args.layers), peak),
                }
                print(
                    f"forward GEMMs {dtype_name:8s} threads={threads} rows={rows:<5d} "
                    f"native {row['native_ms']:7.1f} ms ({gflops_text(row, 'native', peak, 4)})  "
                    f"oneDNN {row['onednn_ms']:7.1f} ms ({gflops_text(row, 'onednn', peak, 4)})  "
                    f"time ratio {row['time_ratio']:.2f}",
                    flush=True,
                )
                row["shapes"] = per_shape(native, ours, onednn, theirs, xs, args, rows, peak)
                results.append(row)
    save_json(args.out, results)


if __name__ == "__main__":
    main()
