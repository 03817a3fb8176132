"""Paged attention over the KV pool for one ragged batch.

Rows of the flattened batch are ordered: all decode rows first (one new token
each), then each prefill segment's rows (several new tokens, possibly on top
of KV already in the pool: a cached prefix or earlier chunks).

Decode attention gathers each sequence's K/V window into one contiguous
``[B, kv_heads, T, head_dim]`` tensor with a length mask and runs two batched
matmuls: on CPU this is several times faster than SDPA with a single query
token, and it avoids the slow strided-slice path (see DESIGN, pitfalls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DecodeBatch:
    """Gather indices for ``B`` decode rows whose longest context is ``T`` tokens."""

    gather_blocks: torch.Tensor  # [B, 1, T] block id of each context position
    gather_offsets: torch.Tensor  # [1, 1, T] offset inside the block
    heads: torch.Tensor  # [1, kv_heads, 1]
    mask: torch.Tensor  # [B, 1, 1, T] True where the position is past the sequence's end

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        context_lens: list[int],
        block_size: int,
        num_kv_heads: int,
        device: str,
    ) -> DecodeBatch:
        max_len = max(context_lens)
        pos = torch.arange(max_len)
        width = (max_len + block_size - 1) // block_size
        table = torch.tensor([t[:width] + [t[0]] * (width - len(t[:width])) for t in block_tables])
        blocks = table[:, pos // block_size]
        lens = torch.tensor(context_lens)
        return cls(
            gather_blocks=blocks[:, None, :].to(device),
            gather_offsets=(pos % block_size)[None, None, :].to(device),
            heads=torch.arange(num_kv_heads)[None, :, None].to(device),
            mask=(pos[None, :] >= lens[:, None])[:, None, None, :].to(device),
        )


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
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [N] block receiving each new token's K/V
    slot_offsets: torch.Tensor  # [N] offset inside that block
    num_decodes: int
    decode: DecodeBatch | None
    prefills: tuple[PrefillSegment, ...]


def write_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store the new tokens' K/V (``[N, kv_heads, head_dim]``) into their slots."""
    k_pool[meta.slot_blocks, :, meta.slot_offsets] = k
    v_pool[meta.slot_blocks, :, meta.slot_offsets] = v


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``q``: ``[N, heads, head_dim]`` -> output ``[N, heads, head_dim]``."""
    out = torch.empty_like(q)
    n_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_pool.shape[1]
    group = n_heads // kv_heads
    if meta.decode is not None:
        d = meta.decode
        b = meta.num_decodes
        keys = k_pool[d.gather_blocks, d.heads, d.gather_offsets]  # [B, kvh, T, hd]
        values = v_pool[d.gather_blocks, d.heads, d.gather_offsets]
        qd = q[:b].view(b, kv_heads, group, head_dim)
        scores = torch.matmul(qd, keys.transpose(-1, -2)).float() * scale  # [B, kvh, g, T]
        scores.masked_fill_(d.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out[:b] = torch.matmul(probs, values).view(b, n_heads, head_dim)
    block_size = k_pool.shape[2]
    for seg in meta.prefills:
        n_blocks = seg.block_table.shape[0]
        keys = (
            k_pool[seg.block_table]
            .transpose(0, 1)
            .reshape(kv_heads, n_blocks * block_size, head_dim)[:, : seg.context_len]
        )
        values = (
            v_pool[seg.block_table]
            .transpose(0, 1)
            .reshape(kv_heads, n_blocks * block_size, head_dim)[:, : seg.context_len]
        )
        qs = q[seg.start : seg.end].transpose(0, 1)  # [heads, n, hd]
        prefix = seg.context_len - seg.num_new
        mask = None
        if prefix > 0:
            rows = torch.arange(seg.num_new, device=q.device)[:, None] + prefix
            mask = torch.arange(seg.context_len, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(
            qs[None],
            keys[None],
            values[None],
            attn_mask=mask,
            is_causal=prefix == 0,
            scale=scale,
            enable_gqa=True,
        )
        out[seg.start : seg.end] = o[0].transpose(0, 1)
    return out
