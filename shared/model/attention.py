"""Paged attention over the KV pool for one ragged batch.

Rows of the flattened batch are ordered: all decode rows first (one new token
each), then each prefill segment's rows (several new tokens, possibly on top
of KV already in the pool: a cached prefix or earlier chunks). Decode rows go
to a :class:`~shared.model.decode_attention.DecodeAttention` implementation;
prefill segments to a :class:`~shared.model.prefill_attention.PrefillAttention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shared.model.attention_impl import AttentionImpl
    from shared.model.decode_attention import DecodeAttention


@dataclass(frozen=True)
class DecodeBatch:
    """``B`` decode rows whose block tables are padded to ``W`` blocks."""

    tables: torch.Tensor  # [B, W] int64 block tables, padded with each row's first block
    lens: torch.Tensor  # [B] int64 context lengths (the new token included)
    mask: torch.Tensor  # [B, 1, W * block_size] True past the sequence's end

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        block_size: int,
        device: str,
    ) -> DecodeBatch:
        width = -(-max(context_lens) // block_size)
        rows: list[list[int]] = []
        for table in block_tables:
            used = list(table[:width])
            rows.append(used + [used[0]] * (width - len(used)))
        pos = torch.arange(width * block_size)
        lens = torch.tensor(context_lens, dtype=torch.int64)
        return cls(
            tables=torch.tensor(rows, dtype=torch.int64, device=device),
            lens=lens.to(device),
            mask=(pos[None, :] >= lens[:, None])[:, None, :].to(device),
        )


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows ``[start, end)`` (sorted by context length) padded to one width."""

    start: int
    end: int
    batch: DecodeBatch


def group_by_width(widths: Sequence[int], *, ratio: float = 2.0, slack: int = 8) -> list[int]:
    """Split ascending block-table widths into runs whose padding stays bounded: a row
    starts a new group when it is over ``ratio`` times (and ``slack`` blocks more than)
    its group's narrowest row. Returns each group's end index. One long context then
    no longer pads every short row of the batch to its width."""
    ends: list[int] = []
    first = 0
    for i, w in enumerate(widths):
        if i > first and w > ratio * widths[first] and w - widths[first] > slack:
            ends.append(i)
            first = i
    if widths:
        ends.append(len(widths))
    return ends


@dataclass(frozen=True)
class PrefillSegment:
    """Rows ``[start, end)`` are the newest tokens of a sequence whose KV spans ``context_len``."""

    start: int
    end: int
    block_table: torch.Tensor  # [ceil(context_len / block_size)] slots
    context_len: int

    @property
    def num_new(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SlotRun:
    """Rows ``[row, row + length)`` go to offsets ``[offset, offset + length)`` of ``block``."""

    row: int
    block: int
    offset: int
    length: int


@dataclass(frozen=True)
class BlockRun:
    """Rows ``[row, row + len(blocks) * block_size)`` fill the whole blocks ``blocks``."""

    row: int
    blocks: torch.Tensor  # [n] slots, int64


@dataclass(frozen=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [num_decodes] slot receiving each decode row's K/V
    slot_offsets: torch.Tensor  # [num_decodes] offset inside that block
    slot_runs: tuple[SlotRun, ...]  # prefill rows filling part of a block: one slice copy each
    num_decodes: int
    decode: tuple[DecodeGroup, ...]  # decode rows in groups of similar context length
    prefills: tuple[PrefillSegment, ...]
    block_runs: tuple[BlockRun, ...] = ()  # prefill rows filling whole blocks: one copy per run
    # every row's slot (decode rows, then prefill rows), for a writer that takes them all
    # at once (DecodeAttention.writes_rows); None where the runner did not make them
    row_blocks: torch.Tensor | None = None  # [N] int64
    row_offsets: torch.Tensor | None = None  # [N] int64
    # the same rows addressed in the slots of each further layer group (sliding-window
    # layers' window parts, see shared.kv.layer_groups); () for a pool of one group
    window_groups: tuple[AttentionMetadata, ...] = ()
    # the sampled rows alone (the step's ``logits_rows``, in their order), each as a
    # decode row over the KV the step has written (see :func:`sampled_rows`): the last
    # layer, once its K/V are in the pool, computes only these rows. None where every
    # row is sampled (a decode-only step)
    sampled: AttentionMetadata | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata addressing layer group ``group``'s slots."""
        return self if group == 0 else self.window_groups[group - 1]


def sampled_rows(groups: Sequence[DecodeGroup], device: str) -> AttentionMetadata:
    """Metadata for rows that each attend as one decode row over KV already in the pool
    and write none: the sampled rows of a step's last layer (none: a prompt's chunk
    before its last). Nothing reads a row's last hidden state but its logits, so the
    other rows' attention, O projection and MLP there are skipped. The logits do not
    change where a decode row is bitwise the same token's prefill row and a GEMM row
    does not depend on its batch: the native and Triton kernels' contract, which the
    identity tests check for the backends an engine picks (torch's fallbacks already
    round prefill and decode rows differently)."""
    empty = torch.empty(0, dtype=torch.long, device=device)
    return AttentionMetadata(
        slot_blocks=empty,
        slot_offsets=empty,
        slot_runs=(),
        num_decodes=groups[-1].end if groups else 0,
        decode=tuple(groups),
        prefills=(),
    )


def split_whole_blocks(
    runs: Sequence[SlotRun], block_size: int, device: str
) -> tuple[list[SlotRun], list[BlockRun]]:
    """Merge runs that fill whole blocks from consecutive rows into :class:`BlockRun` s
    (one ``index_copy_`` for a long prompt instead of one slice copy per block)."""
    partial: list[SlotRun] = []
    whole: list[tuple[int, list[int]]] = []
    for r in runs:
        if r.offset != 0 or r.length != block_size:
            partial.append(r)
        elif whole and whole[-1][0] + len(whole[-1][1]) * block_size == r.row:
            whole[-1][1].append(r.block)
        else:
            whole.append((r.row, [r.block]))
    blocks = [
        BlockRun(row, torch.tensor(ids, dtype=torch.int64, device=device)) for row, ids in whole
    ]
    return partial, blocks


def write_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    decode: DecodeAttention,
) -> None:
    """Store the new tokens' K/V (``[N, kv_heads, head_dim]``) into their slots.

    Decode rows scatter in one call of the decode attention's writer. Prefill rows are contiguous
    within a block: whole blocks go in with one ``index_copy_`` per run of them,
    partly filled ones with a slice copy each (a per-token indexed write of a
    long prompt is ~10x slower on CPU).
    """
    if decode.writes_rows and meta.row_blocks is not None and meta.row_offsets is not None:
        decode.write(k_pool, v_pool, k, v, meta.row_blocks, meta.row_offsets)  # one call
        return
    b = meta.num_decodes
    if b:
        decode.write(k_pool, v_pool, k[:b], v[:b], meta.slot_blocks, meta.slot_offsets)
    block_shape = k_pool.shape[1:]
    for br in meta.block_runs:
        rows = slice(br.row, br.row + br.blocks.shape[0] * block_shape[0])
        k_pool.index_copy_(0, br.blocks, k[rows].view(-1, *block_shape))
        v_pool.index_copy_(0, br.blocks, v[rows].view(-1, *block_shape))
    for r in meta.slot_runs:
        k_pool[r.block, r.offset : r.offset + r.length] = k[r.row : r.row + r.length]
        v_pool[r.block, r.offset : r.offset + r.length] = v[r.row : r.row + r.length]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    impl: AttentionImpl,
    window: int | None = None,
) -> torch.Tensor:
    """``q``: ``[N, heads, head_dim]``, ``k``/``v``: ``[N, kv_heads, head_dim]`` (already
    written to the pools ``[blocks, block_size, kv_heads, head_dim]``). ``window``: each
    token attends to its ``window`` newest tokens only (itself included); None: to all."""
    if not meta.decode and len(meta.prefills) == 1:  # a lone prompt: its rows are all the rows
        seg = meta.prefills[0]
        return impl.prefill(q, k, v, k_pool, v_pool, seg, scale, window)
    out = torch.empty_like(q)
    for g in meta.decode:
        out[g.start : g.end] = impl.decode(
            q[g.start : g.end], k_pool, v_pool, g.batch, scale, window
        )
    for seg in meta.prefills:
        rows = slice(seg.start, seg.end)
        out[rows] = impl.prefill(q[rows], k[rows], v[rows], k_pool, v_pool, seg, scale, window)
    return out


def window_start(context_len: int, window: int | None) -> int:
    """The first position a token at ``context_len - 1`` attends to."""
    return 0 if window is None else max(0, context_len - window)
