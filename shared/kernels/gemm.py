"""ctypes binding of ``gemm.c``: fp32 ``x @ w.T`` on weights packed once into
48-column panels.

Ownership: :meth:`GemmKernel.pack` returns a new tensor the caller keeps for
the weight's lifetime (read-only from then on; several threads may multiply by
it at once). A call only reads ``x`` and the packed weight and writes a new
output, and returns before the call does (ctypes releases the GIL meanwhile).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from shared.kernels.binding import check_return, load_library, refuse
from shared.kernels.build import build_library

SOURCE = Path(__file__).with_name("gemm.c")
_P = ctypes.c_void_p
_I = ctypes.c_int64


class GemmKernel:
    """The compiled kernel. It needs AVX-512: :attr:`available` is False where
    the compiler did not target it."""

    def __init__(self, library: Path):
        lib = load_library(library)
        self.library = library
        lib.baton_gemm_available.restype = ctypes.c_int
        lib.baton_gemm_panel.restype = ctypes.c_int
        self.available = bool(lib.baton_gemm_available())
        self.panel = int(lib.baton_gemm_panel())
        self._pack = lib.baton_gemm_pack_f32
        self._pack.argtypes = [_P, _I, _I, _P]
        self._pack.restype = None
        self._gemm = lib.baton_gemm_f32
        self._gemm.argtypes = [_P, _I, _I, _P, _I, _P, _I, ctypes.c_int]
        self._gemm.restype = ctypes.c_int

    @classmethod
    def build(cls, kernel_dir: Path) -> GemmKernel:
        # torch is loaded first, so the library shares torch's OpenMP runtime
        return cls(build_library(SOURCE, kernel_dir))

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight``: fp32 ``[n, k]`` on the CPU -> ``[ceil(n / panel), k, panel]``."""
        refuse(
            "gemm pack",
            [
                (weight.dtype != torch.float32 or weight.device.type != "cpu", "fp32 CPU weight"),
                (weight.dim() != 2 or 0 in weight.shape, "weight must be a non-empty matrix"),
            ],
        )
        n, k = weight.shape
        w = weight.contiguous()
        packed = torch.empty(-(-n // self.panel), k, self.panel, dtype=torch.float32)
        self._pack(w.data_ptr(), n, k, packed.data_ptr())
        return packed

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """``x``: fp32 ``[m, k]``; returns ``x @ w.T`` as a new ``[m, out_features]``."""
        m, k = x.shape
        refuse(
            "gemm kernel",
            [
                (x.dtype != torch.float32 or x.device.type != "cpu", "x must be fp32 on the CPU"),
                (packed.shape != (-(-out_features // self.panel), k, self.panel), "packed shape"),
                (packed.dtype != torch.float32 or not packed.is_contiguous(), "packed layout"),
            ],
        )
        x = x.contiguous()
        out = torch.empty(m, out_features, dtype=torch.float32)
        if m == 0:
            return out
        rc = self._gemm(
            x.data_ptr(),
            m,
            k,
            packed.data_ptr(),
            out_features,
            out.data_ptr(),
            out_features,
            torch.get_num_threads(),
        )
        check_return("gemm kernel", rc)
        return out
