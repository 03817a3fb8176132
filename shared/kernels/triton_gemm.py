"""``x @ w.T`` on CUDA whose every output row is bitwise independent of the batch.

cuBLAS picks its kernel (tile shape, split-K, stream-K) by the problem's shape,
so a token's row of a projection changes in its last bits with the number of
rows computed beside it: a decode step and a prefill give the same token
different K/V, and cached or failed-over requests stop being token-exact. This
kernel has one tiling for every M: an output element is the same sequence of
tensor-core dot products over K (``BLOCK_K`` at a time, in order, fp32
accumulation, no split over K) whatever the other rows of its tile hold, so a
row's result depends only on that row of ``x``.

Launch and ownership: :func:`matmul` runs on the current CUDA stream; it reads
``x`` and ``w`` and returns a new tensor, safe to use in stream order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# one configuration for every shape: it is what makes rows batch-invariant
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + rn[:, None] * stride_wn + kk[None, :],
            mask=(rn[:, None] < N) & (kk[None, :] < K),
            other=0.0,
        )
        if IEEE:  # fp32 models: full fp32 products, not TF32
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x``: ``[M, K]``, ``w``: ``[N, K]`` (rows dense), same dtype and device;
    returns ``x @ w.T`` as a new ``[M, N]`` tensor of that dtype."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul of {tuple(x.shape)} by {tuple(w.shape)}.T")
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        raise ValueError("the weight's rows must be dense")
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](
        x,
        w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
        IEEE=x.dtype == torch.float32,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out
