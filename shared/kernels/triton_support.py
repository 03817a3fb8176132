"""Whether the Triton kernels (:mod:`shared.kernels.triton_gemm`, ``triton_norm``,
``triton_attention``) can run for a device, without importing Triton where they
cannot (CPU-only hosts never need it)."""

from __future__ import annotations

import importlib.util


def triton_problem(device: str) -> str | None:
    """Why the Triton kernels cannot run on ``device``; None when they can."""
    if not device.startswith("cuda"):
        return f"they run on CUDA devices, not {device}"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
