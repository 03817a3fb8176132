"""This core's arithmetic peak, measured (``benchmarks/native/peak.c``): GFLOP/s of one
instruction issued back to back on one thread, the one the kernels compute ``dtype``
with here. fp32: vfmadd231ps (on zmm, else ymm). bf16: AMX's tdpbf16ps where the CPU
has it and Linux lends the process its tile state (the GEMM and attention kernels then
run on AMX), else vdpbf16ps. The benchmarks that report efficiency divide by it times
their thread count."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.config import default_cache_dir
from shared.kernels.binding import load_library
from shared.kernels.build import build_library

SOURCE = Path(__file__).with_name("native") / "peak.c"


@dataclass(frozen=True)
class Unit:
    """One instruction the peak loop issues: its symbol in peak.c and FLOP per call round."""

    name: str  # what reports call it
    symbol: str  # baton_peak_<symbol>, baton_peak_has_<symbol>
    flop_per_round: int


# 16 chains of vfmadd231ps zmm: 32 fp32 FLOP each
FMA32 = Unit("vfmadd231ps", "fma32", 16 * 32)
# 12 chains of vfmadd231ps ymm: 16 fp32 FLOP each (CPUs without AVX-512)
FMA32_YMM = Unit("vfmadd231ps ymm", "fma32_ymm", 12 * 16)
# 16 chains of vdpbf16ps zmm: 32 products and 32 sums each
DPBF16 = Unit("vdpbf16ps", "dpbf16", 16 * 64)
# 6 tdpbf16ps a round, each a 16 x 16 tile of sums over 32 products
AMX_BF16 = Unit("AMX tdpbf16ps", "amx", 6 * 16 * 16 * 32 * 2)

UNITS = {"float32": (FMA32, FMA32_YMM), "bfloat16": (AMX_BF16, DPBF16)}  # the first present wins


@dataclass(frozen=True)
class Peak:
    unit: str
    gflops_per_core: float

    def share(self, gflops: float, threads: int) -> float:
        """``gflops`` over this peak times ``threads`` cores."""
        return gflops / (self.gflops_per_core * threads)

    def describe(self) -> str:
        return f"{self.gflops_per_core:.0f} GFLOP/s per core ({self.unit})"


def share_text(peak: Peak | None, gflops: float, threads: int) -> str:
    """`` 34% of peak`` for a report line ('' where the peak is unknown)."""
    return f" {peak.share(gflops, threads):4.0%} of peak" if peak is not None else ""


def core_peak(dtype: str, seconds: float = 0.2) -> Peak | None:
    """One core's peak in ``dtype`` on the unit the kernels use (None: no such unit)."""
    lib = load_library(build_library(SOURCE, default_cache_dir() / "kernels"))
    for unit in UNITS[dtype]:
        if getattr(lib, f"baton_peak_has_{unit.symbol}")():
            fn = getattr(lib, f"baton_peak_{unit.symbol}")
            fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_float
            return Peak(unit.name, _rate(fn, seconds) * unit.flop_per_round / 1e9)
    return None


def _rate(fn: Callable[[int], float], seconds: float) -> float:
    """Rounds per second of ``fn(rounds)``, the best of five calls of ~``seconds``/4."""
    rounds = 1 << 12
    while True:  # grow until a call lasts long enough to time
        spent = _timed(fn, rounds)
        if spent >= seconds / 4:
            break
        rounds *= 4
    return rounds / min(_timed(fn, rounds) for _ in range(5))


def _timed(fn: Callable[[int], float], rounds: int) -> float:
    t0 = time.perf_counter()
    fn(rounds)
    return time.perf_counter() - t0


if __name__ == "__main__":
    for d in UNITS:
        p = core_peak(d)
        print(f"{d}: " + (p.describe() if p else "not available on this CPU"))
