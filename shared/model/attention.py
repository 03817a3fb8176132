"""Paged attention over the KV pool for one ragged batch.

Rows of the flattened batch are ordered: all decode rows first (one new token
each), then each prefill segment's rows (several new tokens, possibly on top
of KV already in the pool: a cached prefix or earlier chunks).

Inside a block one layer's K (or V) is ``[block_size, kv_heads, head_dim]``,
so a sequence's blocks are gathered with ``index_select`` (whole blocks,
memcpy speed) into its contiguous ``[T, kv_heads * head_dim]`` window.
Decode attention then scores every query head against that window in one
batched matmul by placing each head's query in the columns of its KV head
(a block-diagonal query, zeros elsewhere): 3x the FLOPs of per-head matmuls,
but the window is read once with no permute copy, which is what costs on CPU.
Measured side by side here, this beats SDPA with a single query token, a
gather of single token slots, per-head matmuls over the strided window, and
a permute copy into ``[B, kv_heads, T, head_dim]`` (see DESIGN, pitfalls). The
buffers live in a workspace reused across layers and steps, because fresh
large allocations cost page faults.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


@dataclass(frozen=True)
class DecodeBatch:
    """``B`` decode rows whose block tables are padded to ``W`` blocks."""

    block_ids: torch.Tensor  # [B * W] row-major block tables, padded with each row's first block
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
        flat: list[int] = []
        for table in block_tables:
            used = list(table[:width])
            flat.extend(used)
            flat.extend([used[0]] * (width - len(used)))
        pos = torch.arange(width * block_size)
        lens = torch.tensor(context_lens)
        return cls(
            block_ids=torch.tensor(flat, device=device),
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
    block_table: torch.Tensor  # [ceil(context_len / block_size)] block ids
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
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [num_decodes] block receiving each decode row's K/V
    slot_offsets: torch.Tensor  # [num_decodes] offset inside that block
    slot_runs: tuple[SlotRun, ...]  # where the prefill rows' K/V go, one slice copy per run
    num_decodes: int
    decode: tuple[DecodeGroup, ...]  # decode rows in groups of similar context length
    prefills: tuple[PrefillSegment, ...]


def write_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store the new tokens' K/V (``[N, kv_heads, head_dim]``) into their slots.

    Decode rows scatter with one indexed write; prefill rows are contiguous
    within a block, so each run is a plain slice copy (an indexed write of a
    long prompt is ~10x slower on CPU).
    """
    b = meta.num_decodes
    if b:
        k_pool[meta.slot_blocks, meta.slot_offsets] = k[:b]
        v_pool[meta.slot_blocks, meta.slot_offsets] = v[:b]
    for r in meta.slot_runs:
        k_pool[r.block, r.offset : r.offset + r.length] = k[r.row : r.row + r.length]
        v_pool[r.block, r.offset : r.offset + r.length] = v[r.row : r.row + r.length]


def _decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    d: DecodeBatch,
    scale: float,
    ws: Workspace,
) -> torch.Tensor:
    """``q``: ``[B, heads, head_dim]`` one token per row."""
    b, n_heads, head_dim = q.shape
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group, width = n_heads // kv_heads, kv_heads * head_dim
    blocks = (d.block_ids.shape[0], block_size, kv_heads, head_dim)
    keys = torch.index_select(k_pool, 0, d.block_ids, out=ws.take("k", blocks)).view(b, -1, width)
    values = torch.index_select(v_pool, 0, d.block_ids, out=ws.take("v", blocks)).view(b, -1, width)
    q_bd = ws.take("q", (b, n_heads, width))
    torch.mul(q.repeat(1, 1, kv_heads), ws.block_diagonal(n_heads, kv_heads, head_dim), out=q_bd)
    scores = torch.bmm(q_bd, keys.transpose(1, 2)).float() * scale  # [B, heads, T]
    scores.masked_fill_(d.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.bmm(probs, values).view(b, kv_heads, group, kv_heads, head_dim)
    # head (k, g) keeps the columns of its own KV head k
    return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(b, n_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    seg: PrefillSegment,
    scale: float,
) -> torch.Tensor:
    """``q``, ``new_k``, ``new_v``: the segment's new tokens, ``[n, heads, head_dim]``."""
    prefix = seg.context_len - seg.num_new
    if prefix == 0:  # nothing cached before: the new K/V are the whole context (same values)
        keys, values = new_k.transpose(0, 1), new_v.transpose(0, 1)
    else:
        kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
        keys = k_pool.index_select(0, seg.block_table).view(-1, kv_heads, head_dim)
        values = v_pool.index_select(0, seg.block_table).view(-1, kv_heads, head_dim)
        keys = keys[: seg.context_len].transpose(0, 1)  # [kvh, T, hd]
        values = values[: seg.context_len].transpose(0, 1)
    mask = None
    if prefix > 0:  # bottom-right aligned causal mask over the cached prefix + new rows
        rows = torch.arange(seg.num_new, device=q.device)[:, None] + prefix
        mask = torch.arange(seg.context_len, device=q.device)[None, :] <= rows
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=mask,
        is_causal=prefix == 0,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    ws: Workspace,
) -> torch.Tensor:
    """``q``: ``[N, heads, head_dim]``, ``k``/``v``: ``[N, kv_heads, head_dim]`` (already
    written to the pools ``[blocks, block_size, kv_heads, head_dim]``)."""
    out = torch.empty_like(q)
    for g in meta.decode:
        out[g.start : g.end] = _decode(q[g.start : g.end], k_pool, v_pool, g.batch, scale, ws)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.end)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_pool, v_pool, seg, scale)
    return out
