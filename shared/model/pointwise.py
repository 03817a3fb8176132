"""The decoder's row-wise ops: RMSNorm, rotary embedding, SwiGLU's and GeGLU's activations.

Three implementations of one boundary. :class:`TorchPointwise` is plain torch,
op by op, as Hugging Face writes them. :class:`TritonPointwise` (CUDA) is
torch but for RMSNorm, a Triton kernel whose rows do not depend on their
batch (the rest is elementwise, which is batch-invariant in torch already).
:class:`NativePointwise` runs each as one pass in C
(``shared/kernels/pointwise.c``): torch spends most of these ops' time on
dispatch and temporaries (RoPE of one decode row's query and key heads is
eight ops, 25-40 us; one C call, 3 us). In bf16 native and torch give the
same bits (but for GeGLU, see pointwise.c); in fp32 they differ in the last
place where sums are ordered differently. :func:`select_pointwise` picks one for a model.

Ownership: inputs are only read, except :meth:`Pointwise.rotary`'s ``qkv``,
which an implementation may rotate in place (it is the caller's scratch: the
fused QKV GEMM's output).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.config import PointwiseBackend
from shared.errors import ConfigError, KernelBuildError
from shared.kernels.pointwise import PointwiseKernel
from shared.kernels.triton_support import kernels_problem
from shared.model.rope import Rope

log = logging.getLogger(__name__)


class Pointwise(ABC):
    name: str

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / rms(x) * weight`` over the last dim of ``[rows, width]``."""

    def add_rms_norm_(
        self, h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """The residual add and the norm after it: ``h += y`` in place (``h`` is the
        caller's own residual stream), then :meth:`rms_norm` of the new ``h``."""
        h.add_(y)
        return self.rms_norm(h, weight, eps)

    @abstractmethod
    def head_rms_norm_(
        self, x: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor, eps: float
    ) -> None:
        """In place: :meth:`rms_norm` of each of the first ``heads`` ``head_dim``-wide
        slices of every row of ``x`` (rows may be strided: a slice of fused QKV rows)."""

    @abstractmethod
    def rotary(
        self, qkv: torch.Tensor, positions: torch.Tensor, rope: Rope, heads: int, kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query ``[rows, heads, d]`` and key ``[rows, kv_heads, d]`` heads
        of the fused rows ``qkv`` (``[q | k | v]``), rotated to ``positions``."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``[rows, 2 * width]`` rows laid out ``[gate | up]``."""

    @abstractmethod
    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up``, laid out as for :meth:`silu_mul`."""


class TorchPointwise(Pointwise):
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight

    def head_rms_norm_(
        self, x: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor, eps: float
    ) -> None:
        part = x[:, : heads * head_dim]
        normed = self.rms_norm(part.reshape(-1, head_dim), weight, eps)
        part.copy_(normed.view(x.shape[0], heads * head_dim))

    def rotary(
        self, qkv: torch.Tensor, positions: torch.Tensor, rope: Rope, heads: int, kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, d = qkv.shape[0], rope.head_dim
        cos, sin = rope.at(positions)
        q = Rope.apply(qkv[:, : heads * d].view(n, heads, d), cos, sin)
        k = Rope.apply(qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d), cos, sin)
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class TritonPointwise(TorchPointwise):
    name = "triton"

    def __init__(self) -> None:
        from shared.kernels.triton_norm import rms_norm

        self._rms_norm = rms_norm

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps)


class NativePointwise(Pointwise):
    name = "native"

    def __init__(self, kernel: PointwiseKernel):
        self.kernel = kernel

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernel.rms_norm(x.contiguous(), weight, eps)

    def add_rms_norm_(
        self, h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.kernel.add_rms_norm_(h, y, weight, eps)

    def head_rms_norm_(
        self, x: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor, eps: float
    ) -> None:
        self.kernel.head_rms_norm_(x, heads, head_dim, weight, eps)

    def rotary(
        self, qkv: torch.Tensor, positions: torch.Tensor, rope: Rope, heads: int, kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, d = qkv.shape[0], rope.head_dim
        self.kernel.rope_(qkv, heads + kv_heads, d, rope.cos, rope.sin, positions)
        q = qkv[:, : heads * d].view(n, heads, d)
        return q, qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernel.silu_mul(gate_up.contiguous())

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernel.gelu_tanh_mul(gate_up.contiguous())


def select_pointwise(
    backend: PointwiseBackend, dtype: torch.dtype, device: str, kernel_dir: Path
) -> Pointwise:
    """``native`` (CPU), ``triton`` (CUDA), each an error where it cannot run;
    ``torch``; or ``auto``: native on CPU where it builds, Triton on CUDA where it
    runs, torch otherwise."""
    if backend == "triton" or (backend == "auto" and device != "cpu"):
        problem = kernels_problem(device, dtype)
        if problem is None:
            return TritonPointwise()
        if backend == "triton":
            raise ConfigError(f"the Triton pointwise kernels are unavailable: {problem}")
        return TorchPointwise()
    if backend == "torch":
        return TorchPointwise()
    problem = None
    if device != "cpu":
        problem = f"they run on the CPU, not {device}"
    elif dtype not in (torch.float32, torch.bfloat16):
        problem = f"they run fp32 and bf16, not {dtype}"
    else:
        try:
            return NativePointwise(PointwiseKernel.build(kernel_dir))
        except KernelBuildError as e:
            problem = str(e)
    if backend == "native":
        raise ConfigError(f"the native pointwise kernels are unavailable: {problem}")
    log.warning("native pointwise kernels unavailable, using torch: %s", problem)
    return TorchPointwise()
