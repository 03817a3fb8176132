"""This core's arithmetic peak, measured (``benchmarks/native/peak.c``): GFLOP/s of one
instruction issued back to back on one thread, the one the kernels compute ``dtype``
with here. fp32: vfmadd231ps (on zmm, else ymm). bf16: AMX's tdpbf16ps where the CPU
has it and Linux lends the process its tile state (the GEMM and attention kernels then
run on AMX), else vdpbf16ps. The benchmarks that report efficiency divide by it times
their thread count, each core's peak measured with that many threads issuing at once
(cores that all compute may run at a lower clock than one alone)."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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
    gflops_per_core: float  # one thread alone
    # thread count -> each core's GFLOP/s with that many threads issuing at once
    at_once: dict[int, float] = field(default_factory=dict)

    def per_core(self, threads: int) -> float:
        return self.at_once.get(threads, self.gflops_per_core)

    def share(self, gflops: float, threads: int) -> float:
        """``gflops`` over ``threads`` cores' peak (measured at once where it was)."""
        return gflops / (self.per_core(threads) * threads)

    def describe(self) -> str:
        text = f"{self.gflops_per_core:.0f} GFLOP/s per core ({self.unit})"
        for n, rate in sorted(self.at_once.items()):
            if n > 1:
                text += f"; {rate:.0f} each with {n} threads at once"
        return text


def share_text(peak: Peak | None, gflops: float, threads: int) -> str:
    """`` 34% of peak`` for a report line ('' where the peak is unknown)."""
    return f" {peak.share(gflops, threads):4.0%} of peak" if peak is not None else ""


def core_peak(dtype: str, seconds: float = 0.2, threads: Iterable[int] = ()) -> Peak | None:
    """One core's peak in ``dtype`` on the unit the kernels use (None: no such unit),
    and each core's with each of ``threads`` threads issuing at once."""
    lib = load_library(build_library(SOURCE, default_cache_dir() / "kernels"))
    for unit in UNITS[dtype]:
        if getattr(lib, f"baton_peak_has_{unit.symbol}")():
            fn = getattr(lib, f"baton_peak_{unit.symbol}")
            fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_float
            gflops = unit.flop_per_round / 1e9
            at_once = {n: _rate(fn, seconds, n) * gflops for n in sorted(set(threads)) if n > 1}
            return Peak(unit.name, _rate(fn, seconds, 1) * gflops, at_once)
    return None


def _rate(fn: Callable[[int], float], seconds: float, threads: int) -> float:
    """Rounds per second each of ``threads`` threads calling ``fn(rounds)`` at once gets,
    the best of five calls of ~``seconds``/4."""
    rounds = 1 << 12
    while True:  # grow until a call lasts long enough to time
        spent = _timed(fn, rounds, threads)
        if spent >= seconds / 4:
            break
        rounds *= 4
    return rounds / min(_timed(fn, rounds, threads) for _ in range(5))


def _timed(fn: Callable[[int], float], rounds: int, threads: int) -> float:
    """Seconds from a common start until the last of ``threads`` calls ends (ctypes
    releases the GIL: the calls run side by side)."""
    if threads == 1:
        t0 = time.perf_counter()
        fn(rounds)
        return time.perf_counter() - t0
    start = threading.Barrier(threads + 1)

    def work() -> None:
        start.wait()
        fn(rounds)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    return time.perf_counter() - t0


if __name__ == "__main__":
    for d in UNITS:
        p = core_peak(d, threads=range(2, (os.cpu_count() or 1) + 1))
        print(f"{d}: " + (p.describe() if p else "not available on this CPU"))
