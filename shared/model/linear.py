"""Weight GEMMs: how the model multiplies activations by its weight matrices.

Three implementations of one boundary. :class:`NativeLinear` is our kernel
(``shared/kernels/gemm.c``, fp32 and bf16) on weights packed into 48-column
panels: over a forward's weights it beats oneDNN at every row count measured,
most at decode batches (32 rows, one thread: fp32 40 vs 55 ms, bf16 21 vs 30
ms), because it prefetches the next panel while computing this one; and a
row's result does not depend on the batch it is in. :class:`OneDNNLinear`
prepacks each weight once into oneDNN's blocked layout and runs oneDNN's
matmul on it; on CPU that is 2.4x faster than ``F.linear`` in fp32 (torch's
fp32 GEMM goes to MKL, which takes AVX2 code on non-Intel CPUs, while oneDNN
picks kernels by ISA), and it skips the per-call weight reorder ``F.linear``
does in bf16. :class:`TritonLinear` is the CUDA GEMM of
:mod:`shared.kernels.triton_gemm`: one tiling for every row count, so a row's
result does not depend on its batch there either (cuBLAS picks kernels by
shape). :class:`TorchLinear` is ``F.linear`` and runs anywhere.
:func:`select_linear` picks one for a model.

Ownership: :meth:`Linear.pack` is called once per weight at load; the model
keeps what it returns for its lifetime (the dense weight may be dropped) and
hands it back on every call. Packed weights are read-only and may be used by
several threads at once.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from shared.config import LinearBackend
from shared.errors import ConfigError, KernelBuildError
from shared.kernels.gemm import GemmKernel, Glu
from shared.kernels.triton_support import kernels_problem

if TYPE_CHECKING:
    from shared.model.pointwise import Pointwise

log = logging.getLogger(__name__)

# MKL's fp32 GEMMs of 2 or 3 rows take a slower path than 4 rows do (over one
# forward's weights, 1 thread: 44 / 49 ms vs 40 ms; bf16 shows no such step), and
# 2-3 rows is a common decode batch, so TorchLinear pads such inputs to 4 rows.
SMALL_GEMM_ROWS = (2, 3)
SMALL_GEMM_PAD_TO = 4


@dataclass(frozen=True)
class PackedWeight:
    """A weight as one :class:`Linear` packed it: ``data`` is in that backend's
    own layout; the logical shape is ``[out_features, in_features]``. ``glu``: a GLU's
    ``[gate | up]`` as :meth:`Linear.pack_glu` packed it, for :meth:`Linear.glu` only."""

    data: torch.Tensor
    out_features: int
    in_features: int
    glu: bool = False


class Linear(ABC):
    name: str
    # rows() can read a weight's rows back from its packed form
    reads_rows: bool = False

    @abstractmethod
    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """``weight``: ``[out, in]`` dense; returns what :meth:`__call__` takes."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
        """``x``: ``[rows, in]``; returns ``x @ weight.T`` as a new ``[rows, out]`` tensor."""

    def pack_glu(self, gate: torch.Tensor, up: torch.Tensor) -> PackedWeight:
        """A GLU MLP's gate and up weights (``[width, in]`` each), for :meth:`glu`."""
        return self.pack(torch.cat([gate, up]))

    def glu(self, x: torch.Tensor, packed: PackedWeight, act: Glu, ops: Pointwise) -> torch.Tensor:
        """``act(x @ gate.T) * (x @ up.T)`` as a new ``[rows, width]``: here the GEMM of
        ``[gate | up]``, then ``ops``' activation and product."""
        gate_up = self(x, packed)
        return ops.silu_mul(gate_up) if act == "silu" else ops.gelu_tanh_mul(gate_up)

    def rows(self, packed: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dense weight as a new ``[len(ids), in]`` tensor, read from
        ``packed`` (exact copies), so a tied embedding needs no dense copy of its own.
        Only where :attr:`reads_rows`."""
        raise NotImplementedError(f"the {self.name} linear backend cannot read weight rows")

    def cache_tag(self) -> str | None:
        """A name for the packed layout when :meth:`pack` returns a plain dense CPU
        tensor whose bytes can be saved and mapped back (one weights file that every
        process on the host shares); None when the packed form is opaque. Backends
        with equal tags pack identically."""
        return None


def _packed(data: torch.Tensor, weight: torch.Tensor) -> PackedWeight:
    return PackedWeight(data, out_features=weight.shape[0], in_features=weight.shape[1])


class TorchLinear(Linear):
    name = "torch"
    reads_rows = True

    def __init__(self, pad_small_gemm: bool):
        self.pad_small_gemm = pad_small_gemm

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        return _packed(weight, weight)

    def __call__(self, x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
        rows = x.shape[0]
        if self.pad_small_gemm and rows in SMALL_GEMM_ROWS:
            return F.linear(F.pad(x, (0, 0, 0, SMALL_GEMM_PAD_TO - rows)), packed.data)[:rows]
        return F.linear(x, packed.data)

    def rows(self, packed: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, packed.data)

    def cache_tag(self) -> str | None:
        return "torch"


class NativeLinear(Linear):
    """The panel kernel: fp32 on AVX-512 or AVX2 with FMA, bf16 on AVX512-BF16. :meth:`load`
    builds it or says why not. Its :meth:`glu` is one pass: each block of gate and
    up sums goes through the activation as it is written out (the same vector
    functions as :class:`~shared.model.pointwise.NativePointwise`'s, so the same
    bits), instead of a ``[rows, 2 * width]`` product written and read again."""

    name = "native"
    reads_rows = True

    def __init__(self, kernel: GemmKernel):
        self.kernel = kernel

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        return _packed(self.kernel.pack(weight), weight)

    def __call__(self, x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
        if packed.glu:
            raise ValueError("a weight packed for glu() is multiplied by glu() only")
        return self.kernel(x, packed.data, packed.out_features)

    def pack_glu(self, gate: torch.Tensor, up: torch.Tensor) -> PackedWeight:
        data = self.kernel.pack_glu(gate, up)
        return PackedWeight(data, 2 * gate.shape[0], gate.shape[1], glu=True)

    def glu(self, x: torch.Tensor, packed: PackedWeight, act: Glu, ops: Pointwise) -> torch.Tensor:
        if not packed.glu:
            return super().glu(x, packed, act, ops)
        return self.kernel.glu(x, packed.data, packed.out_features // 2, act)

    def rows(self, packed: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        return self.kernel.rows(packed.data, ids, packed.in_features)

    def cache_tag(self) -> str | None:
        return f"native-{self.kernel.library.stem}"

    def preferred(self, dtype: torch.dtype) -> bool:
        """Whether ``auto`` takes this kernel: everywhere but fp32 in its AVX2 form,
        which decodes in 0.64-0.74x oneDNN's time but computes a prompt's GEMMs in
        1.0-1.2x (an AMD EPYC Zen 3; ``BATON_LINEAR=native`` takes it)."""
        return dtype != torch.float32 or self.kernel.vector_bits >= 512

    @classmethod
    def load(cls, dtype: torch.dtype, kernel_dir: Path) -> NativeLinear | str:
        """The backend, or why it cannot run in ``dtype`` on this machine."""
        if dtype not in (torch.float32, torch.bfloat16):
            return f"the native GEMM kernel runs fp32 and bf16, not {dtype}"
        try:
            kernel = GemmKernel.build(kernel_dir)
        except KernelBuildError as e:
            return str(e)
        if dtype not in kernel.dtypes:
            need = "AVX-512 or AVX2 with FMA" if dtype == torch.float32 else "AVX-512 with BF16"
            return f"the native GEMM kernel needs {need} for {dtype}, which this CPU lacks"
        return cls(kernel)


class OneDNNLinear(Linear):
    """oneDNN matmul on weights prepacked for it (the ops torch's own compiler
    uses for frozen CPU linears). Private torch ops: :meth:`probe` checks them
    on this build and CPU before a model relies on them."""

    name = "onednn"

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        return _packed(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None), weight)

    def __call__(self, x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, None, "none", [], "")

    @classmethod
    def probe(cls, dtype: torch.dtype) -> str | None:
        """Why this torch build or CPU cannot run it in ``dtype``; None when it can."""
        if not torch.backends.mkldnn.is_available():
            return "torch was built without oneDNN"
        ops = torch.ops.mkldnn
        if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
            return "this torch build lacks the prepacked oneDNN linear ops"
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 40, generator=gen).to(dtype)
        x = torch.randn(5, 40, generator=gen).to(dtype)
        try:
            got = cls()(x, cls().pack(weight))
        except RuntimeError as e:
            return f"oneDNN linear failed in {dtype}: {e}"
        want = F.linear(x.float(), weight.float())
        if got.shape != want.shape or not torch.allclose(got.float(), want, atol=0.05, rtol=0.02):
            return f"oneDNN linear gave wrong results in {dtype}"
        return None


class TritonLinear(Linear):
    """The batch-invariant CUDA GEMM on dense weights (rows read back as they are)."""

    name = "triton"
    reads_rows = True

    def __init__(self) -> None:
        from shared.kernels.triton_gemm import matmul

        self.matmul = matmul

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        return _packed(weight.contiguous(), weight)

    def __call__(self, x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
        return self.matmul(x, packed.data)

    def rows(self, packed: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, packed.data)


def select_linear(
    backend: LinearBackend, dtype: torch.dtype, device: str, kernel_dir: Path
) -> Linear:
    """``native``, ``onednn`` (CPU), ``triton`` (CUDA), each an error where it cannot
    run; ``torch``; or ``auto``: on CPU the native kernel where it builds for
    ``dtype`` (fp32 in its AVX2 form only where oneDNN does not run: see
    :meth:`NativeLinear.preferred`), else oneDNN where it runs, else torch; on CUDA
    Triton where it runs, else torch (whose rows then depend on their batch)."""
    torch_linear = TorchLinear(pad_small_gemm=dtype == torch.float32 and device == "cpu")
    if backend == "triton" or (backend == "auto" and device != "cpu"):
        problem = kernels_problem(device, dtype)
        if problem is None:
            return TritonLinear()
        if backend == "triton":
            raise ConfigError(f"the Triton linear backend is unavailable: {problem}")
        log.warning("Triton GEMM unavailable (%s): cuBLAS, not batch-invariant", problem)
        return torch_linear
    if backend == "torch":
        return torch_linear
    if device != "cpu":
        raise ConfigError(f"the {backend} linear backend runs on the CPU, not {device}")
    native: NativeLinear | str = "not asked for"
    if backend in ("auto", "native"):
        native = NativeLinear.load(dtype, kernel_dir)
        if isinstance(native, NativeLinear) and (backend == "native" or native.preferred(dtype)):
            return native
        if isinstance(native, str) and backend == "native":
            raise ConfigError(f"the native linear backend is unavailable: {native}")
        why = native if isinstance(native, str) else "its AVX2 form computes prompts slower"
        log.info("auto skips the native GEMM, trying oneDNN: %s", why)
    problem = OneDNNLinear.probe(dtype)
    if problem is None:
        return OneDNNLinear()
    if backend == "onednn":
        raise ConfigError(f"the oneDNN linear backend is unavailable: {problem}")
    if isinstance(native, NativeLinear):  # the AVX2 form beats torch at every row count
        return native
    log.warning("oneDNN linear unavailable, using torch: %s", problem)
    return torch_linear
