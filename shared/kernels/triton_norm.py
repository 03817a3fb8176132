"""RMSNorm on CUDA, one program per row: a row's sum of squares is reduced in one
fixed order whatever the number of rows (torch's reduction kernels choose their
split by the tensor's shape, so a row's result could change with its batch).

Math as Hugging Face's ``LlamaRMSNorm``: ``weight * (x * rsqrt(mean(x^2) + eps))``
with the normalisation in fp32, cast to ``x``'s dtype before the weight.

Launch and ownership: :func:`rms_norm` runs on the current CUDA stream and
returns a new tensor, safe to use in stream order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, width, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / width
    normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, normed * w, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x``: ``[rows, width]``; ``weight``: ``[width]`` of ``x``'s dtype."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm of {tuple(x.shape)} with weight {tuple(weight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, width = x.shape
    out = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows,)](
            x,
            weight,
            out,
            width,
            x.stride(0),
            out.stride(0),
            eps,
            BLOCK=block,
            num_warps=4 if block <= 4096 else 8,
        )
    return out
