"""ctypes binding of ``gemm.c``: ``x @ w.T`` in fp32 or bf16 on weights packed
once into 48-column panels.

Ownership: :meth:`GemmKernel.pack` returns a new tensor the caller keeps for
the weight's lifetime (read-only from then on; several threads may multiply by
it at once). A call only reads ``x`` and the packed weight and writes a new
output, and returns before the call does (ctypes releases the GIL meanwhile).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from shared.kernels.binding import bind_dtypes, check_return, load_library, refuse
from shared.kernels.build import build_library

SOURCE = Path(__file__).with_name("gemm.c")
Glu = Literal["silu", "gelu_tanh"]
GLU_CODES: dict[Glu, int] = {"silu": 1, "gelu_tanh": 2}  # vector_math.h's GLU_SILU, GLU_GELU_TANH
_P = ctypes.c_void_p
_I = ctypes.c_int64


class GemmKernel:
    """The compiled kernel: fp32 needs AVX-512, or AVX2 with FMA; bf16 AVX512-BF16.
    :attr:`dtypes` are those the compiler targeted on this machine."""

    def __init__(self, library: Path):
        lib = load_library(library)
        self.library = library
        lib.baton_gemm_panel.restype = ctypes.c_int
        self.panel = int(lib.baton_gemm_panel())
        lib.baton_gemm_vector_bits.restype = ctypes.c_int
        # 512: AVX-512; 256: the AVX2 form, faster than oneDNN at decode's few rows but
        # not yet at a prompt's hundreds (docs/benchmarks.md)
        self.vector_bits = int(lib.baton_gemm_vector_bits())
        self.dtypes: set[torch.dtype] = set()
        for dtype, probe in (
            (torch.float32, lib.baton_gemm_available),
            (torch.bfloat16, lib.baton_gemm_available_bf16),
        ):
            probe.restype = ctypes.c_int
            if probe():
                self.dtypes.add(dtype)
        self._pack = bind_dtypes(lib, "baton_gemm_pack", [_P, _I, _I, _P])
        self._gemm = bind_dtypes(lib, "baton_gemm", [_P, _I, _I, _P, _I, _P, _I, ctypes.c_int])
        self._rows = lib.baton_gemm_rows
        self._rows.argtypes = [_P, _I, _I, _P, _I, _P, ctypes.c_int]
        self._rows.restype = ctypes.c_int
        self._glu = bind_dtypes(
            lib, "baton_gemm_glu", [_P, _I, _I, _P, _I, _P, _I, ctypes.c_int, ctypes.c_int]
        )

    @staticmethod
    def pair(dtype: torch.dtype) -> int:
        """k values per packed step: bf16 packs them in pairs (K padded to even)."""
        return 2 if dtype == torch.bfloat16 else 1

    @classmethod
    def build(cls, kernel_dir: Path) -> GemmKernel:
        # torch is loaded first, so the library shares torch's OpenMP runtime
        return cls(build_library(SOURCE, kernel_dir))

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight``: ``[n, k]`` on the CPU -> ``[ceil(n / panel), k', panel]``
        (``k'``: ``k`` rounded up to the dtype's :meth:`pair`, the padding zero)."""
        refuse(
            "gemm pack",
            [
                (weight.dtype not in self.dtypes, f"dtype {weight.dtype} unsupported here"),
                (weight.device.type != "cpu", "weight must be on the CPU"),
                (weight.dim() != 2 or 0 in weight.shape, "weight must be a non-empty matrix"),
            ],
        )
        n = weight.shape[0]
        w = _pad_k(weight, self.pair(weight.dtype)).contiguous()
        packed = torch.empty(-(-n // self.panel), w.shape[1], self.panel, dtype=weight.dtype)
        self._pack[weight.dtype](w.data_ptr(), n, w.shape[1], packed.data_ptr())
        return packed

    def pack_glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """A GLU's two weights (``[width, k]`` each) for :meth:`glu`: panel ``p`` holds
        gate's rows ``[h p, h p + h)`` and then up's same rows (``h`` = half a panel,
        rows past ``width`` zero), packed as :meth:`pack` packs."""
        refuse("gemm pack_glu", [(gate.shape != up.shape or gate.dim() != 2, "gate/up shapes")])
        half = self.panel // 2
        width, k = gate.shape
        panels = -(-width // half)
        halves = [
            F.pad(w, (0, 0, 0, panels * half - width)).view(panels, half, k) for w in (gate, up)
        ]
        return self.pack(torch.stack(halves, dim=1).view(-1, k))

    def glu(self, x: torch.Tensor, packed: torch.Tensor, width: int, act: Glu) -> torch.Tensor:
        """``act(x @ gate.T) * (x @ up.T)``, ``[m, width]``, of weights :meth:`pack_glu`
        packed: bitwise what :meth:`__call__` on ``[gate | up]`` and then the pointwise
        kernel's GLU give, without writing the gate and up products out."""
        panels = -(-width // (self.panel // 2))
        return self._run(self._glu, x, packed, width, panels, GLU_CODES[act])

    def rows(self, packed: torch.Tensor, ids: torch.Tensor, in_features: int) -> torch.Tensor:
        """Rows ``ids`` of the weight ``packed`` was packed from, ``[len(ids), in_features]``
        (exact copies: a tied embedding is looked up in the packed head, no dense copy)."""
        panels, k, _ = packed.shape
        ids = ids.contiguous()
        refuse(
            "gemm rows",
            [
                (ids.dtype != torch.int64 or ids.dim() != 1, "ids must be a 1-d int64 tensor"),
                (not packed.is_contiguous(), "packed layout"),
            ],
        )
        out = torch.empty(ids.shape[0], k, dtype=packed.dtype)
        steps = k // self.pair(packed.dtype)  # 4-byte units a row: an fp32 or a bf16 pair
        rc = self._rows(
            packed.data_ptr(), steps, panels * self.panel, ids.data_ptr(), ids.shape[0],
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        check_return("gemm rows", rc)
        return out if k == in_features else out[:, :in_features].contiguous()

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """``x``: ``[m, k]`` in the packed weight's dtype; returns ``x @ w.T`` as
        a new ``[m, out_features]``."""
        return self._run(self._gemm, x, packed, out_features, -(-out_features // self.panel))

    def _run(
        self,
        entry: dict[torch.dtype, Any],
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        panels: int,
        *act: int,
    ) -> torch.Tensor:
        m = x.shape[0]
        x = _pad_k(x, self.pair(x.dtype))
        k = x.shape[1]
        refuse(
            "gemm kernel",
            [
                (x.dtype not in self.dtypes or x.device.type != "cpu", "x dtype or device"),
                (packed.dtype != x.dtype or not packed.is_contiguous(), "packed layout"),
                (packed.shape != (panels, k, self.panel), "packed shape"),
            ],
        )
        x = x.contiguous()
        out = torch.empty(m, out_features, dtype=x.dtype)
        if m == 0:
            return out
        rc = entry[x.dtype](
            x.data_ptr(),
            m,
            k,
            packed.data_ptr(),
            out_features,
            out.data_ptr(),
            out_features,
            *act,
            torch.get_num_threads(),
        )
        check_return("gemm kernel", rc)
        return out


def _pad_k(t: torch.Tensor, pair: int) -> torch.Tensor:
    """``t`` with zero columns appended up to a multiple of ``pair``."""
    extra = -t.shape[-1] % pair
    return F.pad(t, (0, extra)) if extra else t
