"""The Triton kernels on a CUDA device: right results, and rows that do not depend on
their batch (the GEMM, RMSNorm) or on the path that computed them (attention: a token
alone in a decode step, or inside a prefill tile). Skipped without CUDA and Triton."""

from __future__ import annotations

import math

import pytest
import torch

from shared.kernels.triton_support import triton_problem

pytestmark = pytest.mark.skipif(
    triton_problem("cuda") is not None, reason=f"needs CUDA and Triton: {triton_problem('cuda')}"
)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_matches_torch_and_rows_are_batch_invariant(dtype: torch.dtype) -> None:
    from shared.kernels.triton_gemm import matmul

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1000, 576, device="cuda", generator=gen).to(dtype)
    x = torch.randn(300, 576, device="cuda", generator=gen).to(dtype)
    full = matmul(x, w)
    want = x.float() @ w.float().T
    if dtype == torch.float32:
        torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-3)
    else:  # the output is rounded to bf16: half a unit in its 8th bit
        torch.testing.assert_close(full.float(), want, rtol=8e-3, atol=2e-2)
    for rows in (slice(0, 1), slice(7, 8), slice(5, 37), slice(64, 65), slice(299, 300)):
        assert torch.equal(matmul(x[rows], w), full[rows]), rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch_and_rows_are_batch_invariant(dtype: torch.dtype) -> None:
    from shared.kernels.triton_norm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(200, 576, device="cuda", generator=gen).to(dtype)
    w = torch.randn(576, device="cuda", generator=gen).to(dtype)
    got = rms_norm(x, w, 1e-5)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * w
    assert (got.float() - want.float()).abs().max().item() < (
        1e-5 if dtype == torch.float32 else 0.05
    )
    for i in (0, 3, 199):
        assert torch.equal(rms_norm(x[i : i + 1], w, 1e-5), got[i : i + 1])


def _pools(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(2)
    # [blocks, layers, K/V, block_size, kv_heads, head_dim], one layer's views
    pool = torch.randn(48, 2, 2, 16, 3, 64, device="cuda", generator=gen).to(dtype)
    return pool, pool[:, 1, 0], pool[:, 1, 1]


def _reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    positions: list[int],
    window: int | None = None,
) -> torch.Tensor:
    ctx = max(positions) + 1
    k = k_pool[table].reshape(-1, 3, 64)[:ctx].float().repeat_interleave(3, 1)
    v = v_pool[table].reshape(-1, 3, 64)[:ctx].float().repeat_interleave(3, 1)
    out = []
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        s = torch.einsum("hd,thd->ht", q[i].float(), k[lo : p + 1]) / 8.0
        out.append(torch.einsum("ht,thd->hd", s.softmax(-1), v[lo : p + 1]))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("prefix", "window"), [(0, None), (3, None), (32, None), (3, 40)])
def test_attention_prefill_rows_equal_decode_rows(
    dtype: torch.dtype, prefix: int, window: int | None
) -> None:
    from shared.kernels import triton_attention as ta

    _, k_pool, v_pool = _pools(dtype)
    table = torch.randperm(48, device="cuda")[:8]
    new = 90
    q = torch.randn(new, 9, 64, device="cuda").to(dtype)
    scale = 1 / math.sqrt(64)
    prefill = ta.paged_attention(
        q, k_pool, v_pool, table.to(torch.int32)[None], ta.Tiles.prefill(new, prefix + new, "cuda"),
        scale, window,
    )  # fmt: skip
    want = _reference(q, k_pool, v_pool, table, list(range(prefix, prefix + new)), window)
    tol = 1e-4 if dtype == torch.float32 else 0.03
    assert (prefill.float() - want).abs().max().item() < tol
    lens = [prefix + i + 1 for i in range(new)]
    tables = table.to(torch.int32)[None].repeat(new, 1)
    decode = ta.paged_attention(
        q, k_pool, v_pool, tables, ta.Tiles.decode(lens, "cuda"), scale, window
    )
    assert torch.equal(decode, prefill)
    # one row alone, and the prompt cut into other chunks: the same bits
    alone = ta.paged_attention(
        q[40:41], k_pool, v_pool, tables[:1], ta.Tiles.decode([lens[40]], "cuda"), scale, window
    )
    assert torch.equal(alone, prefill[40:41])
    tail = ta.paged_attention(
        q[50:], k_pool, v_pool, table.to(torch.int32)[None],
        ta.Tiles.prefill(new - 50, prefix + new, "cuda"), scale, window,
    )  # fmt: skip
    assert torch.equal(tail, prefill[50:])
