"""The native fp32 GEMM kernel against float64, its packing, its batch and thread
invariance, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from shared.config import default_cache_dir
from shared.kernels.gemm import GemmKernel
from tests.shared.kernels.compiler import has_compiler

# (out_features, in_features): panel-aligned and ragged N, the model's K values
SHAPES = [(48, 16), (100, 64), (960, 576), (49, 1536)]


@pytest.fixture(scope="module")
def kernel() -> GemmKernel:
    if not has_compiler():
        pytest.skip("no C compiler on this machine")
    built = GemmKernel.build(default_cache_dir() / "kernels")
    if not built.available:
        pytest.skip("the GEMM kernel needs AVX-512, which this CPU lacks")
    return built


def _operands(rows: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k**0.5


def test_pack_layout(kernel: GemmKernel) -> None:
    """Panel p holds columns [48p, 48p + 48) k-major; columns past N are zero."""
    _, w = _operands(1, 100, 7)
    packed = kernel.pack(w)
    assert packed.shape == (3, 7, kernel.panel)
    for col in (0, 47, 48, 99):
        assert torch.equal(packed[col // 48, :, col % 48], w[col])
    assert not packed[2, :, 100 - 96 :].any()


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 301])
def test_matches_float64(kernel: GemmKernel, rows: int, n: int, k: int) -> None:
    x, w = _operands(rows, n, k, seed=rows)
    got = kernel(x, kernel.pack(w), n)
    want = x.double() @ w.double().T
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # fp32 accumulation over k terms of unit scale: a few ulps times sqrt(k)
    torch.testing.assert_close(got.double(), want, atol=2e-6 * k**0.5, rtol=1e-5)


def test_rows_do_not_depend_on_the_batch_or_threads(kernel: GemmKernel) -> None:
    """Every row is computed in one fixed order, whichever tile it falls in."""
    x, w = _operands(45, 960, 576)
    packed = kernel.pack(w)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = kernel(x, packed, 960)
        for start, end in ((0, 1), (3, 4), (5, 13), (7, 40), (44, 45)):
            assert torch.equal(kernel(x[start:end], packed, 960), full[start:end])
        torch.set_num_threads(2)
        assert torch.equal(kernel(x, packed, 960), full)
    finally:
        torch.set_num_threads(saved)


def test_strided_input_and_empty_batch(kernel: GemmKernel) -> None:
    x, w = _operands(6, 100, 64)
    packed = kernel.pack(w)
    wide = torch.cat([x, x], dim=1)[:, :64]  # rows 128 floats apart
    assert torch.equal(kernel(wide, packed, 100), kernel(x, packed, 100))
    assert kernel(x[:0], packed, 100).shape == (0, 100)


def test_refusals(kernel: GemmKernel) -> None:
    x, w = _operands(4, 100, 64)
    packed = kernel.pack(w)
    with pytest.raises(ValueError, match="fp32"):
        kernel(x.bfloat16(), packed, 100)
    with pytest.raises(ValueError, match="packed shape"):
        kernel(x, packed, 200)
    with pytest.raises(ValueError, match="packed shape"):
        kernel(x[:, :32], packed, 100)
    with pytest.raises(ValueError, match="fp32 CPU weight"):
        kernel.pack(w.bfloat16())
    with pytest.raises(ValueError, match="non-empty matrix"):
        kernel.pack(w[:0])
