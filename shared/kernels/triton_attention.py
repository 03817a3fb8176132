"""Paged attention on CUDA: one kernel for decode rows and prefill rows alike.

A program takes one query head of a *tile*: up to ``TILE_Q`` consecutive
tokens of one sequence (a decode row is a tile of one token). It walks the
sequence's KV blocks through the block table in order, one block of
``block_size`` tokens per iteration, with an online softmax in fp32. Keys
past a token's own position are masked to ``-inf``, which leaves that
token's running max, sum and accumulator bitwise unchanged (``exp(0) == 1``,
``+ 0``), so a token gets the same bits whether it is computed alone in a
decode step, in a prefill tile beside later tokens, or in a tile cut at
another place: prefill rows equal decode rows, and a cached or failed-over
request stays token-exact. K/V are read in place (no gather of the context).
A sliding window (a token attends to its ``window`` newest tokens) starts the
walk at the block of the tile's first token's window and masks the keys before
each token's window alike: blocks wholly before a token's window leave its state
as it was, so the bits still do not depend on the tile.

Launch and ownership: :func:`paged_attention` runs on the current CUDA
stream; it reads the pools and writes a new output tensor, safe to use in
stream order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

TILE_Q = 16  # tokens per program (tl.dot needs 16 rows); decode tiles use one


@dataclass(frozen=True)
class Tiles:
    """Where each tile's tokens are: rows ``[row, row + count)`` of the query, at
    positions ``[pos, pos + count)``, of the sequence in row ``seq`` of the tables.
    Device int32 tensors of one length."""

    row: torch.Tensor
    count: torch.Tensor
    pos: torch.Tensor
    seq: torch.Tensor

    @classmethod
    def build(
        cls, rows: list[int], counts: list[int], positions: list[int], seqs: list[int], device: str
    ) -> Tiles:
        t = torch.tensor([rows, counts, positions, seqs], dtype=torch.int32).to(device)
        return cls(row=t[0], count=t[1], pos=t[2], seq=t[3])

    @classmethod
    def decode(cls, lens: list[int], device: str) -> Tiles:
        """One tile per decode row ``i``: its token at position ``lens[i] - 1``."""
        n = len(lens)
        idx = list(range(n))
        return cls.build(idx, [1] * n, [c - 1 for c in lens], idx, device)

    @classmethod
    def prefill(cls, num_new: int, context_len: int, device: str) -> Tiles:
        """The ``num_new`` newest tokens of one sequence (table row 0), ``TILE_Q`` a tile."""
        starts = list(range(0, num_new, TILE_Q))
        prefix = context_len - num_new
        return cls.build(
            starts,
            [min(TILE_Q, num_new - s) for s in starts],
            [prefix + s for s in starts],
            [0] * len(starts),
            device,
        )


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    tile_row_ptr,
    tile_count_ptr,
    tile_pos_ptr,
    tile_seq_ptr,
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    stride_block,
    stride_tok,
    stride_kvh,
    stride_table,
    scale,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TQ: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOW: tl.constexpr,  # tokens a query attends to, newest first (0: all)
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    row0 = tl.load(tile_row_ptr + tile)
    count = tl.load(tile_count_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)

    offs_m = tl.arange(0, TQ)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, BLOCK)
    valid = offs_m < count
    pos = pos0 + offs_m
    q = tl.load(
        q_ptr + (row0 + offs_m)[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    end = pos0 + count  # the tile's longest context
    m_i = tl.full((TQ,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((TQ,), dtype=tl.float32)
    acc = tl.zeros((TQ, HEAD_DIM), dtype=tl.float32)
    kv_off = kvh * stride_kvh + offs_t[:, None] * stride_tok + offs_d[None, :]
    first = 0
    if WINDOW > 0:  # the block of the first key the tile's first token reads
        first = tl.maximum(pos0 - WINDOW + 1, 0) // BLOCK
    for b in range(first, tl.cdiv(end, BLOCK)):
        slot = tl.load(tables_ptr + seq * stride_table + b).to(tl.int64)
        tok = b * BLOCK + offs_t
        in_ctx = tok < end
        k = tl.load(k_ptr + slot * stride_block + kv_off, mask=in_ctx[:, None], other=0.0)
        v = tl.load(v_ptr + slot * stride_block + kv_off, mask=in_ctx[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(k))
        s = s * scale
        keep = tok[None, :] <= pos[:, None]
        if WINDOW > 0:
            keep = keep & (tok[None, :] > pos[:, None] - WINDOW)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = tl.dot(p, v, input_precision="ieee") if IEEE else tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (row0 + offs_m)[:, None] * stride_on + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=valid[:, None],
    )


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    tiles: Tiles,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """``q``: ``[N, heads, head_dim]``; ``k_pool``/``v_pool``: one layer's ``[blocks,
    block_size, kv_heads, head_dim]`` views (dense inside a block); ``tables``:
    ``[S, W]`` block tables; ``window``: the newest tokens each query attends to (None:
    all). Returns ``[N, heads, head_dim]``; rows no tile covers are left unwritten."""
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1 token, not {window}")
    _n, heads, head_dim = q.shape
    block, kv_heads = k_pool.shape[1], k_pool.shape[2]
    if k_pool.stride()[1:] != (kv_heads * head_dim, head_dim, 1) or k_pool.stride() != (
        v_pool.stride()
    ):
        raise ValueError("paged attention needs K/V pools dense inside each block, alike")
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    num_tiles = tiles.row.shape[0]
    if num_tiles == 0:
        return out
    tables = tables.to(torch.int32) if tables.dtype != torch.int32 else tables
    _paged_attention_kernel[(num_tiles, heads)](
        q,
        k_pool,
        v_pool,
        out,
        tables,
        tiles.row,
        tiles.count,
        tiles.pos,
        tiles.seq,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        tables.stride(0),
        scale,
        GROUP=heads // kv_heads,
        BLOCK=block,
        HEAD_DIM=head_dim,
        TQ=TILE_Q,
        IEEE=q.dtype == torch.float32,
        WINDOW=window or 0,
        num_warps=4,
        num_stages=2,
    )
    return out
