"""Test helper: whether the native kernels can be built on this machine."""

from __future__ import annotations

import pytest

from shared.errors import KernelBuildError
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
