"""Test helper: whether the native kernels can be built on this machine."""

from __future__ import annotations

import pytest

from shared.errors import KernelBuildError
from shared.hardware import cpu_flags
from shared.kernels.build import find_compiler


def has_compiler() -> bool:
    try:
        find_compiler()
    except KernelBuildError:
        return False
    return True


# the engine falls back to the torch paths without a C compiler (tested); the
# kernels themselves can only be tested where one exists
needs_cc = pytest.mark.skipif(not has_compiler(), reason="no C compiler on this machine")


def avx2_only_flags() -> tuple[str, ...]:
    """Extra build flags for the kernels' AVX2 form (the fp32 attention tile of CPUs
    without AVX-512), so that AVX-512 hosts test it too; skips where the default
    build already is that form, or the CPU lacks AVX2 and FMA."""
    flags = cpu_flags()
    if "avx2" not in flags or "fma" not in flags:
        pytest.skip("no AVX2 and FMA on this CPU")
    if "avx512f" not in flags:
        pytest.skip("no AVX-512 on this CPU: the default build is the AVX2 form")
    return ("-mno-avx512f",)
