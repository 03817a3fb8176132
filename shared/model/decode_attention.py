"""Decode attention: one new token per sequence against its paged K/V.

Three implementations of one boundary. :class:`NativeDecode` runs the C kernel
of :mod:`shared.kernels.paged_decode`, which reads K and V in place through
the block tables. :class:`TritonDecode` runs the CUDA kernel of
:mod:`shared.kernels.triton_attention`, in place too, and computes each token
bitwise as :class:`~shared.model.prefill_attention.TritonPrefill` does.
:class:`GatherDecode` is pure torch and runs anywhere (machines without a C
compiler, CUDA without Triton): it gathers each sequence's blocks into a
contiguous window and scores all heads with one batched matmul (see its
docstring). :func:`select_decode_attention` picks one for an engine.

Ownership: an instance belongs to one model runner and runs one forward at a
time (GatherDecode reuses scratch buffers across layers and steps).
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shared.config import AttentionBackend
from shared.errors import ConfigError, KernelBuildError
from shared.kernels.paged_decode import PagedDecodeKernel
from shared.kernels.triton_support import is_pow2, kernels_problem
from shared.model.attention import DecodeBatch

if TYPE_CHECKING:
    from shared.kernels.triton_attention import Tiles

log = logging.getLogger(__name__)


class DecodeAttention(ABC):
    name: str
    # whether a call costs the widest row's length for every row (then the runner
    # groups rows of similar context length into separate calls)
    pads_to_width: bool
    # whether write() stores a long prompt's rows as fast as block copies do (then
    # write_kv hands it every row of a batch in one call)
    writes_rows: bool = False

    @abstractmethod
    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """``q``: ``[B, heads, head_dim]``, one token per row, whose K/V are already in
        the pools (one layer's ``[blocks, block_size, kv_heads, head_dim]`` views); a
        row attends to its ``window`` newest tokens (None: all of them).
        Returns ``[B, heads, head_dim]``; safe to use as soon as the call returns."""

    def write(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
    ) -> None:
        """Store decode rows' new K/V (``[B, kv_heads, head_dim]``) at token
        ``offsets[i]`` of block ``blocks[i]``; done when the call returns."""
        k_pool[blocks, offsets] = k
        v_pool[blocks, offsets] = v


class NativeDecode(DecodeAttention):
    """The C kernel: no gather copy, each query head scored against its own KV head only."""

    name = "native"
    pads_to_width = False
    writes_rows = True

    def __init__(self, kernel: PagedDecodeKernel):
        self.kernel = kernel

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        self.kernel(
            q.contiguous(), k_pool, v_pool, batch.tables, batch.lens, scale, out, window=window
        )
        return out

    def write(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
    ) -> None:
        # one memcpy per row: torch's two-index write costs ~130 us per call at batch 32
        self.kernel.write(k, v, k_pool, v_pool, blocks, offsets)


class Workspace:
    """Scratch buffers reused by every forward (one forward at a time; not thread-safe)."""

    def __init__(self, dtype: torch.dtype, device: str):
        self.dtype = dtype
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel + numel // 4, dtype=self.dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    def block_diagonal(self, n_heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
        """``[n_heads, kv_heads * head_dim]`` 0/1 selector: head i keeps its KV head's columns."""
        key = f"block_diagonal:{n_heads}:{kv_heads}:{head_dim}"
        sel = self._buffers.get(key)
        if sel is None:
            owner = torch.arange(n_heads) // (n_heads // kv_heads)
            cols = torch.arange(kv_heads * head_dim) // head_dim
            sel = (owner[:, None] == cols[None, :]).to(self.dtype).to(self.device)
            self._buffers[key] = sel
        return sel


class GatherDecode(DecodeAttention):
    """Pure torch. Inside a block one layer's K (or V) is ``[block_size, kv_heads,
    head_dim]``, so a sequence's blocks are gathered with ``index_select`` (whole
    blocks, memcpy speed) into its contiguous ``[T, kv_heads * head_dim]`` window.
    All query heads are then scored against that window in one batched matmul by
    placing each head's query in the columns of its KV head (a block-diagonal
    query, zeros elsewhere): 3x the FLOPs of per-head matmuls, but the window is
    read once with no permute copy. Measured on CPU, this beats SDPA with a single
    query token, per-head matmuls over the strided window, and a permute copy
    into ``[B, kv_heads, T, head_dim]`` (see DESIGN, pitfalls)."""

    name = "torch"
    pads_to_width = True

    def __init__(self, dtype: torch.dtype, device: str):
        self.workspace = Workspace(dtype, device)

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        ws = self.workspace
        b, n_heads, head_dim = q.shape
        block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
        group, width = n_heads // kv_heads, kv_heads * head_dim
        ids = batch.tables.view(-1)
        blocks = (ids.shape[0], block_size, kv_heads, head_dim)
        keys = torch.index_select(k_pool, 0, ids, out=ws.take("k", blocks)).view(b, -1, width)
        values = torch.index_select(v_pool, 0, ids, out=ws.take("v", blocks)).view(b, -1, width)
        q_bd = ws.take("q", (b, n_heads, width))
        selector = ws.block_diagonal(n_heads, kv_heads, head_dim)
        torch.mul(q.repeat(1, 1, kv_heads), selector, out=q_bd)
        scores = torch.bmm(q_bd, keys.transpose(1, 2)).float() * scale  # [B, heads, T]
        scores.masked_fill_(batch.mask, float("-inf"))
        if window is not None:  # keys before each row's window
            pos = torch.arange(scores.shape[-1], device=scores.device)
            early = pos[None, :] < (batch.lens[:, None] - window)
            scores.masked_fill_(early[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.bmm(probs, values).view(b, kv_heads, group, kv_heads, head_dim)
        # head (k, g) keeps the columns of its own KV head k
        return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(b, n_heads, head_dim)


class TritonDecode(DecodeAttention):
    """The CUDA kernel: one tile per decode row, K/V read in place through the block
    tables (no gather of the context), each token computed bitwise as a prefill
    computes it. The step's tiles are built once and reused by every layer."""

    name = "triton"
    pads_to_width = False

    def __init__(self) -> None:
        from shared.kernels import triton_attention

        self.kernel = triton_attention
        self._batch: DecodeBatch | None = None
        self._tiles: Tiles | None = None
        self._tables = torch.empty(0)

    def bind(self, batch: DecodeBatch, tiles: Tiles, tables: torch.Tensor) -> None:
        """Use ``tiles`` and the int32 ``tables`` for ``batch`` (static buffers a CUDA graph
        captures; nothing is read back from the device)."""
        self._batch, self._tiles, self._tables = batch, tiles, tables

    def _prepare(self, batch: DecodeBatch) -> tuple[Tiles, torch.Tensor]:
        if batch is not self._batch or self._tiles is None:
            lens = batch.lens.tolist()
            self._tiles = self.kernel.Tiles.decode(lens, str(batch.tables.device))
            self._tables = batch.tables.to(torch.int32)
            self._batch = batch
        return self._tiles, self._tables

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        tiles, tables = self._prepare(batch)
        return self.kernel.paged_attention(q, k_pool, v_pool, tables, tiles, scale, window)


def triton_attention_problem(
    dtype: torch.dtype, head_dim: int, block_size: int, device: str
) -> str | None:
    """Why the Triton attention kernel cannot run this model; None when it can."""
    problem = kernels_problem(device, dtype)
    if problem is None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        problem = f"it does not run {dtype}"
    if problem is None and not (is_pow2(head_dim) and head_dim >= 16):
        problem = f"head_dim {head_dim} is not a power of two of at least 16"
    if problem is None and not (is_pow2(block_size) and block_size >= 16):
        problem = f"block_size {block_size} is not a power of two of at least 16"
    return problem


def select_decode_attention(
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    kernel_dir: Path,
    *,
    head_dim: int = 64,
    block_size: int = 16,
) -> DecodeAttention:
    """``native`` (the C kernel, CPU), ``triton`` (the CUDA kernel), each an error where
    it cannot run; ``torch``; or ``auto``: native on CPU where it builds, Triton on
    CUDA where it runs, torch otherwise."""
    if backend == "triton" or (backend == "auto" and device != "cpu"):
        problem = triton_attention_problem(dtype, head_dim, block_size, device)
        if problem is None:
            return TritonDecode()
        if backend == "triton":
            raise ConfigError(f"the Triton attention kernel is unavailable: {problem}")
        log.warning(
            "Triton attention unavailable (%s): torch attention, whose results are not "
            "batch-invariant on %s",
            problem,
            device,
        )
        return GatherDecode(dtype, device)
    if backend == "torch":
        return GatherDecode(dtype, device)
    if device != "cpu":
        raise ConfigError(f"the native decode attention kernel runs on the CPU, not {device}")
    try:
        kernel = PagedDecodeKernel.build(kernel_dir)
    except KernelBuildError as e:
        if backend == "native":
            raise ConfigError(f"the native decode attention kernel is unavailable: {e}") from e
        log.warning("native decode attention unavailable, using torch: %s", e)
        return GatherDecode(dtype, device)
    if not kernel.supports(dtype):
        if backend == "native":
            raise ConfigError(f"the native decode attention kernel does not support {dtype}")
        return GatherDecode(dtype, device)
    return NativeDecode(kernel)
