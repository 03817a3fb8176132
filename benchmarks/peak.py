"""This core's arithmetic peak, measured (``benchmarks/native/peak.c``): GFLOP/s of
vfmadd231ps (fp32) or vdpbf16ps (bf16) issued back to back on one thread. The
benchmarks that report efficiency divide by it times their thread count. AMX is
not measured: on an AMX host a bf16 GEMM can exceed the vdpbf16ps figure."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from pathlib import Path

from shared.config import default_cache_dir
from shared.kernels.binding import load_library
from shared.kernels.build import build_library

SOURCE = Path(__file__).with_name("native") / "peak.c"
FLOP_PER_INSTRUCTION = {"float32": 32, "bfloat16": 64}
CHAINS = 16


def peak_gflops(dtype: str, seconds: float = 0.2) -> float | None:
    """One core's peak in ``dtype`` (None where the CPU lacks the instruction)."""
    lib = load_library(build_library(SOURCE, default_cache_dir() / "kernels"))
    name = {"float32": "fma32", "bfloat16": "dpbf16"}[dtype]
    if not getattr(lib, f"baton_peak_has_{name}")():
        return None
    fn = getattr(lib, f"baton_peak_{name}")
    fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_float
    rounds = 1 << 16
    while True:  # grow until a call lasts long enough to time
        t0 = time.perf_counter()
        fn(rounds)
        spent = time.perf_counter() - t0
        if spent >= seconds / 4:
            break
        rounds *= 4
    best = min(_timed(fn, rounds) for _ in range(5))
    return rounds * CHAINS * FLOP_PER_INSTRUCTION[dtype] / best / 1e9


def _timed(fn: Callable[[int], float], rounds: int) -> float:
    t0 = time.perf_counter()
    fn(rounds)
    return time.perf_counter() - t0


if __name__ == "__main__":
    for d in FLOP_PER_INSTRUCTION:
        g = peak_gflops(d)
        print(f"{d}: " + (f"{g:.0f} GFLOP/s per core" if g else "not available on this CPU"))
