"""Whether the Triton kernels (:mod:`shared.kernels.triton_gemm`, ``triton_norm``,
``triton_attention``) can run for a device, without importing Triton where they
cannot (CPU-only hosts never need it)."""

from __future__ import annotations

import functools
import importlib.util
import logging
import math

import torch

log = logging.getLogger(__name__)


def triton_problem(device: str) -> str | None:
    """Why the Triton kernels cannot run on ``device``; None when they can."""
    if not device.startswith("cuda"):
        return f"they run on CUDA devices, not {device}"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


@functools.cache
def kernels_problem(device: str, dtype: torch.dtype) -> str | None:
    """Why the Triton kernels cannot serve ``dtype`` on ``device``: Triton missing, or
    a kernel that fails to build or gives wrong results on this GPU and driver (each
    kernel runs once on a small problem against torch). None when they can; checked
    once per process."""
    problem = triton_problem(device)
    if problem is not None:
        return problem
    try:
        wrong = _self_test(device, dtype)
    except Exception as exc:  # compiler and launch errors have no common base class
        log.warning("the Triton kernels failed their self-test on %s: %r", device, exc)
        return f"the Triton kernels failed on {device}: {type(exc).__name__}: {exc}"
    return None if wrong is None else f"the Triton {wrong} gave wrong results on {device}"


def _self_test(device: str, dtype: torch.dtype) -> str | None:
    from shared.kernels import triton_attention, triton_gemm, triton_norm

    gen = torch.Generator(device=device).manual_seed(0)
    tol = 2e-3 if dtype == torch.float32 else 0.1

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        return bool((got.float() - want.float()).abs().max().item() < tol)

    x = torch.randn(5, 96, device=device, generator=gen).to(dtype)
    w = torch.randn(80, 96, device=device, generator=gen).to(dtype)
    if not close(triton_gemm.matmul(x, w), x.float() @ w.float().T):
        return "GEMM"
    nw = torch.randn(96, device=device, generator=gen).to(dtype)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * nw
    if not close(triton_norm.rms_norm(x, nw, 1e-6), want):
        return "RMSNorm"
    pool = torch.randn(4, 2, 16, 2, 32, device=device, generator=gen).to(dtype)  # K/V, 2 heads
    q = torch.randn(20, 4, 32, device=device, generator=gen).to(dtype)
    table = torch.tensor([[2, 0]], dtype=torch.int32, device=device)
    got = triton_attention.paged_attention(
        q, pool[:, 0], pool[:, 1], table, triton_attention.Tiles.prefill(20, 20, device), 32**-0.5
    )
    keys = pool[[2, 0], 0].reshape(32, 2, 32)[:20].float().repeat_interleave(2, 1)
    values = pool[[2, 0], 1].reshape(32, 2, 32)[:20].float().repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) / math.sqrt(32)
    scores = scores.masked_fill(torch.ones(20, 20, device=device).triu(1).bool(), float("-inf"))
    if not close(got, torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)):
        return "attention"
    return None


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
