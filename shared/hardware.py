"""What the machine offers, for defaults that depend on it (``--dtype auto``).

Reads ``/proc/cpuinfo`` for CPU features (no torch import: the gateway and the
launcher use these too); a CUDA device is asked through torch only when one is
named.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

# native bf16 dot products: AVX512-BF16 (Cooper Lake, Zen 4 and later) or AMX
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (benchmarks and test runs name the host they ran on)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


@dataclass(frozen=True)
class DTypeChoice:
    dtype: str  # "float32" | "bfloat16"
    reason: str


def auto_dtype(device: str, flags: frozenset[str] | None = None) -> DTypeChoice:
    """bfloat16 where the hardware computes it natively (a GPU that supports it, a CPU
    with AVX512-BF16 or AMX), float32 elsewhere (emulated bf16 is slower than fp32)."""
    if device.startswith("cuda"):
        import torch  # only for a CUDA device, which needs torch anyway

        if torch.cuda.is_bf16_supported():
            return DTypeChoice("bfloat16", f"{device} supports bfloat16")
        return DTypeChoice("float32", f"{device} lacks bfloat16")
    have = cpu_flags() if flags is None else flags
    native = [f for f in BF16_FLAGS if f in have]
    if native:
        return DTypeChoice("bfloat16", f"the CPU has {' and '.join(native)}")
    return DTypeChoice("float32", "the CPU has no native bfloat16 dot products")
