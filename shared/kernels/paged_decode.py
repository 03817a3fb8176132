"""ctypes binding of ``paged_decode.c``: decode attention read in place through block tables.

Ownership: the caller owns every tensor; the kernel only reads ``q``, the pools,
``tables`` and ``lens`` and writes ``out``, and returns before the call does
(ctypes releases the GIL for its duration). The tensors must stay alive and
unmodified until then, which a synchronous call guarantees.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from shared.kernels.binding import (
    bind_dtypes,
    check_return,
    load_library,
    pool_problems,
    refuse,
)
from shared.kernels.build import build_library

SOURCE = Path(__file__).with_name("paged_decode.c")
_P = ctypes.c_void_p
_I = ctypes.c_int64
_ARGTYPES = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I, ctypes.c_int]
_WRITE_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _P,
    _P,
    _I,
    _I,
    _P,
    _P,
    _P,
    _P,
    _I,
    _I,
    _I,
    _I,
    _I,
    ctypes.c_int,
]


class PagedDecodeKernel:
    """The compiled kernel, one entry point per storage dtype (fp32, bf16)."""

    def __init__(self, library: Path):
        lib = load_library(library)
        self.library = library
        self._entry = bind_dtypes(lib, "baton_paged_decode", _ARGTYPES)
        self._write = lib.baton_paged_write
        self._write.argtypes = _WRITE_ARGTYPES
        self._write.restype = ctypes.c_int

    @classmethod
    def build(cls, kernel_dir: Path) -> PagedDecodeKernel:
        # torch must be loaded first: the library then binds to torch's own OpenMP
        # runtime (same soname) and shares its thread pool instead of starting another
        return cls(build_library(SOURCE, kernel_dir))

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._entry

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        *,
        window: int | None = None,
    ) -> None:
        """``q``/``out``: ``[B, heads, head_dim]``; pools: one layer's
        ``[blocks, block_size, kv_heads, head_dim]`` views (blocks may be strided);
        ``tables``: ``[B, W]`` int64 block ids; ``lens``: ``[B]`` int64 context lengths;
        ``window``: each row attends to its newest ``window`` tokens (None: all)."""
        b, heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_pool.shape
        _check(q, k_pool, v_pool, tables, lens, out)
        if window is not None and window <= 0:
            raise ValueError(f"paged decode kernel: window {window} <= 0")
        rc = self._entry[q.dtype](
            q.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            out.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            b,
            tables.shape[1],
            heads,
            kv_heads,
            head_dim,
            block_size,
            k_pool.stride(0),
            scale,
            window or 0,  # 0: no window
            torch.get_num_threads(),
        )
        check_return("paged decode kernel", rc)

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
    ) -> None:
        """Row ``i`` of ``k``/``v`` (``[N, kv_heads, head_dim]``, rows may be strided)
        into token ``offsets[i]`` of block ``blocks[i]`` of the pools; what
        ``k_pool[blocks, offsets] = k`` stores, without the indexing machinery."""
        n = k.shape[0]
        _, _, kv_heads, head_dim = k_pool.shape
        row = (kv_heads, head_dim)
        problems = [
            *pool_problems(k_pool, v_pool),
            (k.device.type != "cpu", "tensors must be on the CPU"),
            (len({k.dtype, v.dtype, k_pool.dtype, v_pool.dtype}) != 1, "dtypes"),
            (k.shape[1:] != row or v.shape != k.shape, "row shape"),
            (
                k.stride()[1:] != (head_dim, 1) or v.stride()[1:] != (head_dim, 1),
                "rows must be dense",
            ),
            (blocks.dtype != torch.int64 or not blocks.is_contiguous(), "blocks must be int64"),
            (offsets.dtype != torch.int64 or not offsets.is_contiguous(), "offsets must be int64"),
            (blocks.shape != (n,) or offsets.shape != (n,), "one block and offset per row"),
        ]
        refuse("paged K/V write", problems)
        item = k.element_size()
        rc = self._write(
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0) * item,
            v.stride(0) * item,
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            blocks.data_ptr(),
            offsets.data_ptr(),
            n,
            k_pool.shape[0],
            k_pool.shape[1],
            k_pool.shape[2] * k_pool.shape[3] * item,
            k_pool.stride(0) * item,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise IndexError("paged K/V write: a block or offset is outside the pool")


def _check(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The kernel trusts raw pointers, so the layout it assumes is checked here."""
    b = q.shape[0]
    _, block_size, _, head_dim = k_pool.shape
    problems = [
        *pool_problems(k_pool, v_pool),
        (q.device.type != "cpu", "tensors must be on the CPU"),
        (q.dtype != k_pool.dtype or q.dtype != v_pool.dtype or q.dtype != out.dtype, "dtypes"),
        (not q.is_contiguous() or not out.is_contiguous(), "q and out must be contiguous"),
        (out.shape != q.shape or q.shape[2] != head_dim, "q/out shape"),
        (tables.dtype != torch.int64 or not tables.is_contiguous(), "tables must be int64"),
        (tables.dim() != 2 or tables.shape[0] != b, "tables shape"),
        (lens.dtype != torch.int64 or lens.shape != (b,), "lens must be int64 [B]"),
        (b > 0 and int(lens.max()) > tables.shape[1] * block_size, "lens exceed the tables"),
    ]
    refuse("paged decode kernel", problems)
