"""Prefill attention: a segment's new tokens against their sequence's context.

Three implementations of one boundary. :class:`NativePrefill` runs the C kernel
of :mod:`shared.kernels.paged_prefill`, which reads K/V through the block table
in place; each token's result is bitwise what the native decode kernel computes
for it, however a prompt is chunked. :class:`TritonPrefill` is the same promise
on CUDA (:mod:`shared.kernels.triton_attention`, one kernel for decode and
prefill rows). :class:`SdpaPrefill` is torch's SDPA and runs anywhere (CUDA
without Triton, or a CPU without a C compiler), with no such promise.
:func:`select_prefill_attention` picks one for an engine.

Ownership: an instance belongs to one model runner and runs one call at a time.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from shared.config import AttentionBackend
from shared.errors import ConfigError, KernelBuildError
from shared.kernels.paged_prefill import PagedPrefillKernel
from shared.model.attention import PrefillSegment
from shared.model.decode_attention import triton_attention_problem

if TYPE_CHECKING:
    from shared.kernels.triton_attention import Tiles

log = logging.getLogger(__name__)


class PrefillAttention(ABC):
    name: str

    @abstractmethod
    def __call__(
        self,
        q: torch.Tensor,
        new_k: torch.Tensor,
        new_v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        seg: PrefillSegment,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """``q``, ``new_k``, ``new_v``: the segment's new tokens (``[n, heads | kv_heads,
        head_dim]``), whose K/V are already in the pools too (one layer's ``[blocks,
        block_size, kv_heads, head_dim]`` views); a token attends to its ``window``
        newest tokens (None: all of them). Returns ``[n, heads, head_dim]``;
        safe to use as soon as the call returns."""


class SdpaPrefill(PrefillAttention):
    """torch SDPA over the context: the new K/V as they are when nothing was cached
    before, else the sequence's blocks gathered from the pools."""

    name = "sdpa"

    def __call__(
        self,
        q: torch.Tensor,
        new_k: torch.Tensor,
        new_v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        seg: PrefillSegment,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        prefix = seg.context_len - seg.num_new
        if prefix == 0:  # nothing cached before: the new K/V are the whole context
            keys, values = new_k.transpose(0, 1), new_v.transpose(0, 1)
        else:
            kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
            keys = k_pool.index_select(0, seg.block_table).view(-1, kv_heads, head_dim)
            values = v_pool.index_select(0, seg.block_table).view(-1, kv_heads, head_dim)
            keys = keys[: seg.context_len].transpose(0, 1)  # [kvh, T, hd]
            values = values[: seg.context_len].transpose(0, 1)
        mask = None
        if prefix > 0 or window is not None:  # bottom-right aligned causal mask
            rows = torch.arange(seg.num_new, device=q.device)[:, None] + prefix
            cols = torch.arange(seg.context_len, device=q.device)[None, :]
            mask = cols <= rows
            if window is not None:
                mask &= cols > rows - window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys[None],
            values[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)


class NativePrefill(PrefillAttention):
    """The C kernel: K/V read through the block table, fp32 math, each token
    computed as decode computes it (``benchmarks/attention_bench.py`` for speed)."""

    name = "native"

    def __init__(self, kernel: PagedPrefillKernel):
        self.kernel = kernel

    def __call__(
        self,
        q: torch.Tensor,
        new_k: torch.Tensor,
        new_v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        seg: PrefillSegment,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype)  # q's rows may be strided, out's are not
        self.kernel(q, k_pool, v_pool, seg.block_table, seg.context_len, scale, out, window=window)
        return out


class TritonPrefill(PrefillAttention):
    """The CUDA kernel: the segment's tokens in tiles, K/V read through the block table
    in place, each token bitwise what :class:`~shared.model.decode_attention.TritonDecode`
    computes for it. A segment's tiles are built once and reused by every layer."""

    name = "triton"

    def __init__(self) -> None:
        from shared.kernels import triton_attention

        self.kernel = triton_attention
        self._seg: PrefillSegment | None = None
        self._tiles: Tiles | None = None
        self._table = torch.empty(0)

    def __call__(
        self,
        q: torch.Tensor,
        new_k: torch.Tensor,
        new_v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        seg: PrefillSegment,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        if seg is not self._seg or self._tiles is None:
            device = str(seg.block_table.device)
            self._tiles = self.kernel.Tiles.prefill(seg.num_new, seg.context_len, device)
            self._table = seg.block_table.to(torch.int32)[None, :]
            self._seg = seg
        return self.kernel.paged_attention(
            q, k_pool, v_pool, self._table, self._tiles, scale, window
        )


def select_prefill_attention(
    backend: AttentionBackend,
    dtype: torch.dtype,
    head_dim: int,
    device: str,
    kernel_dir: Path,
    *,
    block_size: int = 16,
) -> PrefillAttention:
    """``native`` (the C kernel, CPU), ``triton`` (the CUDA kernel), each an error where
    it cannot run; ``torch`` (SDPA); or ``auto``: native on CPU where it builds and
    supports the model, Triton on CUDA where it runs, SDPA otherwise."""
    if backend == "triton" or (backend == "auto" and device != "cpu"):
        problem = triton_attention_problem(dtype, head_dim, block_size, device)
        if problem is None:
            return TritonPrefill()
        if backend == "triton":
            raise ConfigError(f"the Triton attention kernel is unavailable: {problem}")
        return SdpaPrefill()
    if backend == "torch":
        return SdpaPrefill()
    problem = None
    kernel = None
    if device != "cpu":
        problem = f"it runs on the CPU, not {device}"
    else:
        try:
            kernel = PagedPrefillKernel.build(kernel_dir)
        except KernelBuildError as e:
            problem = str(e)
        else:
            if not kernel.supports(dtype, head_dim):
                problem = f"it does not support {dtype} with head_dim {head_dim}"
    if kernel is not None and problem is None:
        return NativePrefill(kernel)
    if backend == "native":
        raise ConfigError(f"the native prefill attention kernel is unavailable: {problem}")
    log.info("native prefill attention unavailable (%s), using SDPA", problem)
    return SdpaPrefill()
