"""How the row-wise ops' implementation is chosen. (The kernels' own tests are in
tests/shared/kernels/test_pointwise.py.)"""

from __future__ import annotations

import pytest
import torch

from shared.config import default_cache_dir
from shared.errors import ConfigError, KernelBuildError
from shared.kernels.pointwise import PointwiseKernel
from shared.model.pointwise import NativePointwise, TorchPointwise, select_pointwise
from tests.shared.kernels.compiler import has_compiler

KDIR = default_cache_dir() / "kernels"


def test_selection() -> None:
    assert isinstance(select_pointwise("torch", torch.float32, "cpu", KDIR), TorchPointwise)
    assert isinstance(select_pointwise("auto", torch.float16, "cuda", KDIR), TorchPointwise)
    with pytest.raises(ConfigError, match="not cuda"):
        select_pointwise("native", torch.float16, "cuda", KDIR)
    with pytest.raises(ConfigError, match=r"not torch\.float16"):
        select_pointwise("native", torch.float16, "cpu", KDIR)
    want = NativePointwise if has_compiler() else TorchPointwise
    for dtype in (torch.float32, torch.bfloat16):
        assert isinstance(select_pointwise("auto", dtype, "cpu", KDIR), want)


def test_a_failed_build_is_a_clear_error_and_auto_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(cls: type[PointwiseKernel], kernel_dir: object) -> PointwiseKernel:
        raise KernelBuildError("no compiler here")

    monkeypatch.setattr(PointwiseKernel, "build", classmethod(fail))
    with pytest.raises(ConfigError, match="no compiler here"):
        select_pointwise("native", torch.float32, "cpu", KDIR)
    assert isinstance(select_pointwise("auto", torch.float32, "cpu", KDIR), TorchPointwise)
