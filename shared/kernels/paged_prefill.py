"""ctypes binding of the prefill entry of ``paged_decode.c``: a prompt's attention
over its context, K/V read through the block table, each token computed by the
decode kernel's own task (so prefill and decode agree bit for bit).

Ownership: the caller owns every tensor; the kernel only reads ``q``, the pools
and ``table`` and writes ``out``, and returns before the call does (ctypes
releases the GIL for its duration). The new tokens' K/V must already be in the
pools.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

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
# q, q's row stride, k, v, out, table, n, context_len, heads, kv_heads, head_dim,
# block_size, block_stride, num_blocks, scale, window, threads
_ARGTYPES = [_P, _I, _P, _P, _P, _P, *[_I] * 8, ctypes.c_float, _I, ctypes.c_int]


class PagedPrefillKernel:
    """The compiled kernel, one entry point per storage dtype (fp32, bf16); an
    AVX-512 path where the compiler targets it, a portable one elsewhere (the same
    as decode's on the same machine)."""

    def __init__(self, library: Path):
        lib = load_library(library)
        self.library = library
        self._entry = bind_dtypes(lib, "baton_paged_prefill", _ARGTYPES)

    @classmethod
    def build(cls, kernel_dir: Path) -> PagedPrefillKernel:
        # torch is loaded first, so the library shares torch's OpenMP runtime
        return cls(build_library(SOURCE, kernel_dir))

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in self._entry and head_dim > 0

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        table: torch.Tensor,
        context_len: int,
        scale: float,
        out: torch.Tensor,
        *,
        window: int | None = None,
    ) -> None:
        """``q``/``out``: ``[n, heads, head_dim]``, the newest ``n`` tokens of a
        sequence of ``context_len`` (``q``'s rows may be strided: the query heads of
        fused QKV rows); ``table``: its int64 block ids; pools: one
        layer's ``[blocks, block_size, kv_heads, head_dim]`` views; ``window``: each
        token attends to its newest ``window`` tokens (None: all)."""
        n, heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_pool.shape
        problems = [
            *pool_problems(k_pool, v_pool),
            (q.device.type != "cpu", "tensors must be on the CPU"),
            (len({q.dtype, out.dtype, k_pool.dtype, v_pool.dtype}) != 1, "dtypes"),
            (not self.supports(q.dtype, head_dim), "dtype or head_dim unsupported"),
            (q.stride()[1:] != (head_dim, 1), "q's heads must be contiguous in each row"),
            (not out.is_contiguous(), "out must be contiguous"),
            (out.shape != q.shape or k_pool.shape[3] != head_dim, "q/out shape"),
            (heads % kv_heads != 0, "heads not a multiple of kv_heads"),
            (not 0 < n <= context_len, "query rows outside the context"),
            (window is not None and window <= 0, "window <= 0"),
            (table.dtype != torch.int64 or not table.is_contiguous(), "table must be int64"),
            (table.shape != (-(-context_len // block_size),), "table length"),
        ]
        refuse("paged prefill kernel", problems)
        rc = self._entry[q.dtype](  # refuses block ids outside the pool
            q.data_ptr(),
            q.stride(0),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            out.data_ptr(),
            table.data_ptr(),
            n,
            context_len,
            heads,
            kv_heads,
            head_dim,
            block_size,
            k_pool.stride(0),
            k_pool.shape[0],
            scale,
            window or 0,  # 0: no window
            torch.get_num_threads(),
        )
        check_return("paged prefill kernel (table outside the pool?)", rc)
