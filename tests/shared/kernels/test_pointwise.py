"""The native row-wise kernels (RMSNorm, RoPE, silu * up) against the torch ops
they replace: the same bits in bf16, the last place in fp32."""

from __future__ import annotations

import pytest
import torch

from shared.config import default_cache_dir
from shared.kernels.pointwise import PointwiseKernel
from shared.model.arch import ModelArch
from shared.model.pointwise import TorchPointwise
from shared.model.rope import Rope
from tests.shared.kernels.compiler import has_compiler

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 5, 16, 33]
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


@pytest.fixture(scope="module")
def kernel() -> PointwiseKernel:
    if not has_compiler():
        pytest.skip("no C compiler on this machine")
    return PointwiseKernel.build(default_cache_dir() / "kernels")


def _arch() -> ModelArch:
    return ModelArch(
        vocab_size=64,
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=64,
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm(kernel: PointwiseKernel, dtype: torch.dtype, rows: int) -> None:
    x = _randn(rows, 576, dtype=dtype, seed=rows, scale=3.0)
    w = _randn(576, dtype=dtype, seed=100)
    _same(kernel.rms_norm(x, w, 1e-5), TorchPointwise().rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 100])  # a width with a tail past its 16-lane vectors
def test_add_rms_norm_is_the_add_then_the_norm(
    kernel: PointwiseKernel, dtype: torch.dtype, width: int
) -> None:
    h = _randn(33, width, dtype=dtype, seed=5, scale=3.0)
    y = _randn(33, width, dtype=dtype, seed=6)
    w = _randn(width, dtype=dtype, seed=7)
    want_h = h + y
    want = kernel.rms_norm(want_h, w, 1e-5)
    got = kernel.add_rms_norm_(h, y, w, 1e-5)
    assert torch.equal(h, want_h)  # the residual stream, added to in place
    assert torch.equal(got, want)
    _same(got, TorchPointwise().add_rms_norm_(want_h.clone(), torch.zeros_like(y), w, 1e-5))
    with pytest.raises(ValueError, match="y shape"):
        kernel.add_rms_norm_(h, y[:, :-1].contiguous(), w, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul(kernel: PointwiseKernel, dtype: torch.dtype, rows: int) -> None:
    # width 1544: 96 vectors of 16 and a scalar tail of 8; values far into both tails of silu
    gate_up = _randn(rows, 2 * 1544, dtype=dtype, seed=rows, scale=8.0)
    _same(kernel.silu_mul(gate_up), TorchPointwise().silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_head_rms_norm_in_place_on_strided_rows(
    kernel: PointwiseKernel, dtype: torch.dtype, rows: int
) -> None:
    """Gemma's QK-norm: each head slice of fused QKV rows normalized in place, as
    rms_norm does a row; the rest of each row untouched."""
    qkv = _randn(rows, 6 * 256, dtype=dtype, seed=rows, scale=3.0)
    w = _randn(256, dtype=dtype, seed=7)
    want = qkv.clone()
    TorchPointwise().head_rms_norm_(want[:, 256:], 4, 256, w, 1e-6)
    got = qkv.clone()
    kernel.head_rms_norm_(got[:, 256:], 4, 256, w, 1e-6)
    # torch sums the squares in another order: a bf16 result may round the other way
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)
    assert torch.equal(got[:, :256], qkv[:, :256]) and torch.equal(got[:, 1280:], qkv[:, 1280:])
    rows_alone = qkv[:, 256:1280].reshape(-1, 256).contiguous()
    assert torch.equal(got[:, 256:1280].reshape(-1, 256), kernel.rms_norm(rows_alone, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_gelu_tanh_mul(kernel: PointwiseKernel, dtype: torch.dtype, rows: int) -> None:
    """Gemma's GeGLU: gelu (tanh approximation) of the gate times up. torch computes
    1 + tanh(y), which cancels for very negative gates; the kernel the same function
    as a sigmoid, so results may differ by a unit in the last place (bf16) or a few
    (fp32, near zero)."""
    gate_up = _randn(rows, 2 * 1544, dtype=dtype, seed=rows, scale=6.0)
    got, want = kernel.gelu_tanh_mul(gate_up), TorchPointwise().gelu_tanh_mul(gate_up)
    bf16 = dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2**-7 if bf16 else 1e-5, atol=1e-5, check_dtype=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rope_rotates_query_and_key_heads_only(
    kernel: PointwiseKernel, dtype: torch.dtype, rows: int
) -> None:
    rope = Rope(_arch(), dtype, "cpu")
    qkv = _randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, seed=rows)
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(rows))
    want_q, want_k = TorchPointwise().rotary(qkv, positions, rope, HEADS, KV_HEADS)
    rotated = qkv.clone()
    kernel.rope_(rotated, HEADS + KV_HEADS, HEAD_DIM, rope.cos, rope.sin, positions)
    q_end, k_end = HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM
    _same(rotated[:, :q_end].view(rows, HEADS, HEAD_DIM), want_q)
    _same(rotated[:, q_end:k_end].view(rows, KV_HEADS, HEAD_DIM), want_k)
    assert torch.equal(rotated[:, k_end:], qkv[:, k_end:])  # V untouched


def test_rows_do_not_depend_on_the_batch_or_threads(kernel: PointwiseKernel) -> None:
    x = _randn(40, 576, dtype=torch.float32, seed=1)
    w = _randn(576, dtype=torch.float32, seed=2)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = kernel.rms_norm(x, w, 1e-5)
        silu = kernel.silu_mul(x)
        gelu = kernel.gelu_tanh_mul(x)
        torch.set_num_threads(2)
        assert torch.equal(kernel.rms_norm(x, w, 1e-5), full)
        assert torch.equal(kernel.silu_mul(x), silu)
        assert torch.equal(kernel.gelu_tanh_mul(x), gelu)
        assert torch.equal(kernel.rms_norm(x[3:4], w, 1e-5), full[3:4])
    finally:
        torch.set_num_threads(saved)


def test_refusals(kernel: PointwiseKernel) -> None:
    x = torch.randn(4, 64)
    rope = Rope(_arch(), torch.float32, "cpu")
    with pytest.raises(ValueError, match="contiguous rows"):
        kernel.rms_norm(x.t(), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="weight shape"):
        kernel.rms_norm(x, torch.ones(63), 1e-5)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernel.silu_mul(x.half())
    with pytest.raises(ValueError, match="even"):
        kernel.silu_mul(x[:, :63].contiguous())
    qkv = torch.randn(2, 15 * HEAD_DIM)
    with pytest.raises(ValueError, match="positions outside"):
        kernel.rope_(qkv, 12, HEAD_DIM, rope.cos, rope.sin, torch.tensor([0, 4096]))
    with pytest.raises(ValueError, match="heads x head_dim"):
        kernel.rope_(qkv, 16, HEAD_DIM, rope.cos, rope.sin, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="angle table dtype"):
        kernel.rope_(qkv, 12, HEAD_DIM, rope.cos.bfloat16(), rope.sin, torch.tensor([0, 1]))
