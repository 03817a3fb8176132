"""Where a decode step's time goes: weight GEMMs, decode attention, K/V writes,
the rest of the forward (norms, RoPE, activations, residuals), and the engine
around it (scheduling, sampling, outputs).

Runs the engine as ``engine_bench`` does (context 512, greedy) with timing
wrappers around its GEMM and attention implementations, at each batch size
given. Figures are per step, medians over ``--repeats`` windows; the wrappers
add a few microseconds per call, so the totals run slightly above
``engine_bench``'s.

    python -m benchmarks.step_breakdown --dtype float32 --threads 1 --batch 1 32
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.decode_args import decode_parser, load_default_model
from benchmarks.engine_bench import Ours
from benchmarks.results import save_json
from shared.kernels.gemm import Glu
from shared.model.attention import DecodeBatch
from shared.model.attention_impl import AttentionImpl
from shared.model.decode_attention import DecodeAttention
from shared.model.linear import Linear, PackedWeight
from shared.model.pointwise import Pointwise

PARTS = ("gemm", "attention", "kv_write", "forward")


class Clock:
    """Seconds spent in each named part since the last :meth:`reset`."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(PARTS, 0.0)

    def reset(self) -> None:
        self.spent = dict.fromkeys(PARTS, 0.0)

    def timed(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.spent[part] += time.perf_counter() - t0


class TimedLinear(Linear):
    def __init__(self, inner: Linear, clock: Clock):
        self.inner, self.clock, self.name = inner, clock, inner.name
        self.reads_rows = inner.reads_rows

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        return self.inner.pack(weight)

    def rows(self, packed: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.rows(packed, ids)  # a tied embedding's lookup: not a GEMM

    def __call__(self, x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
        out: torch.Tensor = self.clock.timed("gemm", self.inner, x, packed)
        return out

    def pack_glu(self, gate: torch.Tensor, up: torch.Tensor) -> PackedWeight:
        return self.inner.pack_glu(gate, up)

    def glu(self, x: torch.Tensor, packed: PackedWeight, act: Glu, ops: Pointwise) -> torch.Tensor:
        """The gate/up GEMM with its activation (fused where the backend fuses them)."""
        out: torch.Tensor = self.clock.timed("gemm", self.inner.glu, x, packed, act, ops)
        return out


class TimedDecode(DecodeAttention):
    def __init__(self, inner: DecodeAttention, clock: Clock):
        self.inner, self.clock = inner, clock
        self.name, self.pads_to_width = inner.name, inner.pads_to_width

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        out: torch.Tensor = self.clock.timed(
            "attention", self.inner, q, k_pool, v_pool, batch, scale, window
        )
        return out

    def write(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
    ) -> None:
        self.clock.timed("kv_write", self.inner.write, k_pool, v_pool, k, v, blocks, offsets)


def breakdown(
    ours: Ours, clock: Clock, batch: int, ctx: int, steps: int, repeats: int
) -> dict[str, float]:
    ours.start_decode(batch, ctx, steps * (repeats + 1) + steps // 4)
    ours.decode_window(steps)  # warm-up
    windows: list[dict[str, float]] = []
    for _ in range(repeats):
        clock.reset()
        total = ours.decode_window(steps)
        windows.append({"step": total, **clock.spent})
    while ours.engine.has_unfinished():
        ours.engine.step()
    med = {k: statistics.median(w[k] for w in windows) / steps * 1e3 for k in windows[0]}
    return {
        "batch": batch,
        "step_ms": med["step"],
        "gemm_ms": med["gemm"],
        "attention_ms": med["attention"],
        "kv_write_ms": med["kv_write"],
        "other_forward_ms": med["forward"] - med["gemm"] - med["attention"] - med["kv_write"],
        "outside_forward_ms": med["step"] - med["forward"],
    }


def main() -> None:
    p = decode_parser(__doc__, repeats=5)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    loaded = load_default_model(args)
    clock = Clock()
    loaded.model.gemm = TimedLinear(loaded.model.gemm, clock)
    ours = Ours(loaded, args.dtype)
    runner = ours.engine.runner
    runner.attention = AttentionImpl(
        TimedDecode(runner.attention.decode, clock), runner.attention.prefill
    )
    forward = loaded.model.forward
    loaded.model.forward = lambda *a: clock.timed("forward", forward, *a)  # type: ignore[method-assign]
    rows = []
    for batch in args.batch:
        row = breakdown(ours, clock, batch, args.ctx, args.steps, args.repeats)
        rows.append(row)
        print(
            f"{args.dtype} threads={args.threads} batch={batch:<3d} step {row['step_ms']:6.1f} ms: "
            f"GEMM {row['gemm_ms']:5.1f}, attention {row['attention_ms']:5.1f}, "
            f"K/V write {row['kv_write_ms']:4.1f}, rest of forward {row['other_forward_ms']:4.1f}, "
            f"outside forward {row['outside_forward_ms']:4.1f}",
            flush=True,
        )
    save_json(args.out, {"dtype": args.dtype, "threads": args.threads, "rows": rows})


if __name__ == "__main__":
    main()
