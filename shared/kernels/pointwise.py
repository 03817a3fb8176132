"""ctypes binding of ``pointwise.c``: RMSNorm, RoPE, silu(gate) * up and
gelu_tanh(gate) * up, one pass over the rows each.

Ownership: the caller owns every tensor. :meth:`PointwiseKernel.rms_norm` and
:meth:`~PointwiseKernel.silu_mul` only read their inputs and return new
tensors; :meth:`~PointwiseKernel.rope_` rotates rows of the caller's tensor in
place. Each returns before the call does (ctypes releases the GIL meanwhile).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from shared.kernels.binding import bind_dtypes, load_library, refuse
from shared.kernels.build import build_library

SOURCE = Path(__file__).with_name("pointwise.c")
_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_T = ctypes.c_int
DTYPES = (torch.float32, torch.bfloat16)


def _cpu_rows(what: str, t: torch.Tensor) -> None:
    refuse(
        what,
        [
            (t.dtype not in DTYPES or t.device.type != "cpu", "fp32 or bf16 CPU tensors"),
            (t.dim() != 2 or t.stride(1) != 1 or t.stride(0) != t.shape[1], "contiguous rows"),
        ],
    )


class PointwiseKernel:
    """The compiled kernels: any C compiler; AVX-512 vectorizes silu."""

    def __init__(self, library: Path):
        lib = load_library(library)
        self.library = library
        self._rms_norm = bind_dtypes(lib, "baton_rms_norm", [_P, _P, _P, _I, _I, _F, _T])
        self._add_rms_norm = bind_dtypes(
            lib, "baton_add_rms_norm", [_P, _P, _P, _P, _I, _I, _F, _T]
        )
        self._rope = bind_dtypes(lib, "baton_rope", [_P, _I, _I, _I, _I, _P, _P, _I, _P, _T])
        self._head_rms_norm = bind_dtypes(
            lib, "baton_head_rms_norm", [_P, _I, _I, _I, _I, _P, _F, _T]
        )
        self._silu_mul = bind_dtypes(lib, "baton_silu_mul", [_P, _P, _I, _I, _T])
        self._gelu_mul = bind_dtypes(lib, "baton_gelu_tanh_mul", [_P, _P, _I, _I, _T])

    @classmethod
    def build(cls, kernel_dir: Path) -> PointwiseKernel:
        # torch is loaded first, so the library shares torch's OpenMP runtime
        return cls(build_library(SOURCE, kernel_dir))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x``: ``[rows, width]``; ``weight``: ``[width]``, same dtype."""
        _cpu_rows("rms_norm", x)
        refuse(
            "rms_norm",
            [(weight.shape != x.shape[1:] or weight.dtype != x.dtype, "weight shape or dtype")],
        )
        out = torch.empty_like(x)
        self._rms_norm[x.dtype](
            x.data_ptr(),
            weight.contiguous().data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
            torch.get_num_threads(),
        )
        return out

    def add_rms_norm_(
        self, h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``h += y`` in place (rounded as the dtype's add rounds), then :meth:`rms_norm`
        of the new ``h``, in one pass; ``h``, ``y``: contiguous ``[rows, width]``."""
        _cpu_rows("add_rms_norm", h)
        refuse(
            "add_rms_norm",
            [
                (not h.is_contiguous(), "h must be contiguous (it is written in place)"),
                (y.shape != h.shape or y.dtype != h.dtype, "y shape or dtype"),
                (weight.shape != h.shape[1:] or weight.dtype != h.dtype, "weight shape or dtype"),
            ],
        )
        out = torch.empty_like(h)
        self._add_rms_norm[h.dtype](
            h.data_ptr(),
            y.contiguous().data_ptr(),
            weight.contiguous().data_ptr(),
            out.data_ptr(),
            h.shape[0],
            h.shape[1],
            eps,
            torch.get_num_threads(),
        )
        return out

    def rope_(
        self,
        qkv: torch.Tensor,
        heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Rotate the first ``heads`` ``head_dim``-wide slices of each row of
        ``qkv`` in place by the angles of ``positions`` (int64, one per row) in
        the ``[max_position, head_dim]`` tables ``cos`` / ``sin``."""
        _cpu_rows("rope", qkv)
        rows = qkv.shape[0]
        refuse(
            "rope",
            [
                (head_dim % 2 != 0 or heads * head_dim > qkv.shape[1], "heads x head_dim"),
                (cos.shape != sin.shape or cos.shape[1:] != (head_dim,), "angle table shape"),
                (cos.dtype != qkv.dtype or sin.dtype != qkv.dtype, "angle table dtype"),
                (not cos.is_contiguous() or not sin.is_contiguous(), "angle tables contiguous"),
                (positions.dtype != torch.int64 or positions.shape != (rows,), "positions"),
            ],
        )
        rc = self._rope[qkv.dtype](  # refuses positions outside the tables
            qkv.data_ptr(),
            rows,
            qkv.shape[1],
            heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[0],
            positions.contiguous().data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError("rope refused its arguments: positions outside the tables")

    def head_rms_norm_(
        self, x: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor, eps: float
    ) -> None:
        """In place: RMSNorm of each of the first ``heads`` ``head_dim``-wide slices of
        every row of ``x`` (``[rows, >= heads * head_dim]``, a view whose rows may be
        strided, e.g. the query heads of fused QKV rows); ``weight``: ``[head_dim]``."""
        refuse(
            "head_rms_norm",
            [
                (x.device.type != "cpu", "tensors must be on the CPU"),
                (x.dtype not in DTYPES or weight.dtype != x.dtype, "fp32 or bf16, one dtype"),
                (x.dim() != 2 or x.stride(1) != 1, "rows of contiguous values"),
                (heads * head_dim > x.shape[1], "heads x head_dim"),
                (weight.shape != (head_dim,) or not weight.is_contiguous(), "weight shape"),
            ],
        )
        self._head_rms_norm[x.dtype](
            x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, weight.data_ptr(), eps,
            torch.get_num_threads(),
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up``: ``[rows, 2 * width]`` as ``[gate | up]``; returns
        ``silu(gate) * up``, ``[rows, width]``."""
        return self._glu("silu_mul", self._silu_mul, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """As :meth:`silu_mul` with GELU's tanh approximation (Gemma's GeGLU)."""
        return self._glu("gelu_tanh_mul", self._gelu_mul, gate_up)

    @staticmethod
    def _glu(what: str, entry: dict[torch.dtype, Any], gate_up: torch.Tensor) -> torch.Tensor:
        _cpu_rows(what, gate_up)
        refuse(what, [(gate_up.shape[1] % 2 != 0, "gate_up width must be even")])
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype)
        entry[gate_up.dtype](
            gate_up.data_ptr(), out.data_ptr(), rows, width, torch.get_num_threads()
        )
        return out
