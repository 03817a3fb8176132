"""The native GEMM kernel (fp32, bf16) against float64, its packing, its batch
and thread invariance, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from shared.config import default_cache_dir
from shared.kernels.gemm import GemmKernel, Glu
from shared.kernels.pointwise import PointwiseKernel
from tests.shared.kernels.compiler import has_compiler

# (out_features, in_features): panel-aligned and ragged N, the model's K values, odd K
SHAPES = [(48, 16), (100, 64), (960, 576), (49, 1536), (50, 7)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def built() -> GemmKernel:
    if not has_compiler():
        pytest.skip("no C compiler on this machine")
    return GemmKernel.build(default_cache_dir() / "kernels")


def _kernel(built: GemmKernel, dtype: torch.dtype) -> GemmKernel:
    if dtype not in built.dtypes:
        need = "AVX-512 or AVX2+FMA" if dtype == torch.float32 else "AVX512-BF16"
        pytest.skip(f"the GEMM kernel cannot run {dtype} on this CPU (it needs {need})")
    return built


def _operands(
    rows: int, n: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    return x.to(dtype), w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_layout(built: GemmKernel, dtype: torch.dtype) -> None:
    """Panel p holds columns [48p, 48p + 48), k-major (bf16: k in pairs, K padded
    to even); columns past N and padded k are zero."""
    kernel = _kernel(built, dtype)
    _, w = _operands(1, 100, 7, dtype)
    packed = kernel.pack(w)
    pair = kernel.pair(dtype)
    k_padded = 7 + (pair - 1)
    assert packed.shape == (3, k_padded, kernel.panel) and packed.dtype == dtype
    steps = packed.view(3, k_padded // pair, kernel.panel, pair)
    for col in (0, 47, 48, 99):
        column = steps[col // 48, :, col % 48, :].reshape(-1)
        assert torch.equal(column[:7], w[col]) and not column[7:].any()
    assert not steps[2, :, 100 - 96 :, :].float().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 301])
def test_matches_float64(built: GemmKernel, rows: int, n: int, k: int, dtype: torch.dtype) -> None:
    kernel = _kernel(built, dtype)
    x, w = _operands(rows, n, k, dtype, seed=rows)
    got = kernel(x, kernel.pack(w), n)
    want = x.double() @ w.double().T
    assert got.shape == (rows, n) and got.dtype == dtype
    if dtype == torch.float32:
        # fp32 accumulation over k terms of unit scale: a few ulps times sqrt(k)
        torch.testing.assert_close(got.double(), want, atol=2e-6 * k**0.5, rtol=1e-5)
    else:
        # exact bf16 products summed in fp32, one bf16 rounding of the result
        torch.testing.assert_close(got.double(), want, atol=1e-5 * k**0.5, rtol=2**-8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_the_batch_or_threads(built: GemmKernel, dtype: torch.dtype) -> None:
    """Every row is computed in one fixed order, whichever tile it falls in: decode's
    few rows and a prompt's hundreds take different tiles, and a long prompt's rows
    blocks of rows that stay in L2 (700 rows of K = 576: 3 blocks in bf16, 5 in fp32)."""
    kernel = _kernel(built, dtype)
    x, w = _operands(700, 960, 576, dtype)
    packed = kernel.pack(w)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = kernel(x, packed, 960)
        for start, end in (
            (0, 1), (3, 4), (5, 13), (7, 40), (44, 45), (60, 190), (300, 301), (230, 250),
            (100, 700), (699, 700),
        ):  # fmt: skip
            assert torch.equal(kernel(x[start:end], packed, 960), full[start:end])
        torch.set_num_threads(2)
        assert torch.equal(kernel(x, packed, 960), full)
    finally:
        torch.set_num_threads(saved)


def test_strided_input_and_empty_batch(built: GemmKernel) -> None:
    kernel = _kernel(built, torch.float32)
    x, w = _operands(6, 100, 64)
    packed = kernel.pack(w)
    wide = torch.cat([x, x], dim=1)[:, :64]  # rows 128 floats apart
    assert torch.equal(kernel(wide, packed, 100), kernel(x, packed, 100))
    assert kernel(x[:0], packed, 100).shape == (0, 100)


@pytest.fixture(scope="module")
def pointwise() -> PointwiseKernel:
    return PointwiseKernel.build(default_cache_dir() / "kernels")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("width", "k"), [(1536, 576), (2048, 640), (100, 64), (40, 7)])
def test_glu_is_the_gemm_then_the_pointwise_glu(
    built: GemmKernel, pointwise: PointwiseKernel, dtype: torch.dtype, act: Glu, width: int, k: int
) -> None:
    """The fused gate/up GEMM and activation: bitwise the plain GEMM of [gate | up] and
    then the pointwise kernel's GLU, at every row count (AMX or not: K decides), for
    widths that fill the half panels and widths that do not."""
    kernel = _kernel(built, dtype)
    x, gate = _operands(700, width, k, dtype, seed=width)
    up = _operands(1, width, k, dtype, seed=width + 1)[1] * 3
    fused, plain = kernel.pack_glu(gate, up), kernel.pack(torch.cat([gate, up]))
    glu = pointwise.silu_mul if act == "silu" else pointwise.gelu_tanh_mul
    for rows in (1, 5, 17, 33, 301, 700):
        want = glu(kernel(x[:rows], plain, 2 * width))
        assert torch.equal(kernel.glu(x[:rows], fused, width, act), want), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [576, 7])
def test_rows_read_back_from_the_packing(built: GemmKernel, dtype: torch.dtype, k: int) -> None:
    """A tied embedding's lookup in the packed head: exact copies of the dense rows, in
    the ids' order, repeats and all (odd K: the padding column left out)."""
    kernel = _kernel(built, dtype)
    _, w = _operands(1, 100, k, dtype)
    packed = kernel.pack(w)
    ids = torch.tensor([0, 47, 48, 99, 5, 5, 73])
    assert torch.equal(kernel.rows(packed, ids, k), w[ids])
    assert kernel.rows(packed, ids[:0], k).shape == (0, k)
    with pytest.raises(ValueError, match="gemm rows"):
        kernel.rows(packed, torch.tensor([0, 144]), k)  # past the packed panels


def test_refusals(built: GemmKernel) -> None:
    kernel = _kernel(built, torch.float32)
    x, w = _operands(4, 100, 64)
    packed = kernel.pack(w)
    with pytest.raises(ValueError, match="x dtype"):
        kernel(x.half(), packed, 100)
    if torch.bfloat16 in kernel.dtypes:
        with pytest.raises(ValueError, match="packed layout"):
            kernel(x.bfloat16(), packed, 100)
    with pytest.raises(ValueError, match="packed shape"):
        kernel(x, packed, 200)
    with pytest.raises(ValueError, match="packed shape"):
        kernel(x[:, :32], packed, 100)
    with pytest.raises(ValueError, match="unsupported"):
        kernel.pack(w.half())
    with pytest.raises(ValueError, match="non-empty matrix"):
        kernel.pack(w[:0])
