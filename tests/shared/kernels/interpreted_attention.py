"""Checks of the Triton attention kernel run by Triton's interpreter on the CPU (run
as a module with ``TRITON_INTERPRET=1`` set before Triton is imported; see
``test_triton_interpreted.py``): right results with and without a sliding window
for a token alone in a decode step, inside a prefill tile and after another cut of
the prompt. Not their bits: the interpreter's dot is numpy's matmul, whose rows
round differently with the rows beside them (the compiled kernel's do not, which
``test_triton_kernels.py`` checks on a GPU)."""

from __future__ import annotations

import math
import os

import torch

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 32, 16


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int], window: int | None
) -> torch.Tensor:
    """fp64 attention of each row over the keys at ``(pos - window, pos]``."""
    group = HEADS // KV_HEADS
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    out = []
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        s = torch.einsum("hd,thd->ht", q[i].double(), kk[lo : p + 1]) / math.sqrt(DIM)
        out.append(torch.einsum("ht,thd->hd", s.softmax(-1), vv[lo : p + 1]))
    return torch.stack(out)


def check(window: int | None, prefix: int) -> None:
    from shared.kernels import triton_attention as ta

    gen = torch.Generator().manual_seed(prefix + (window or 0))
    blocks, new = 8, 70
    k_pool = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    v_pool = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    table = torch.randperm(blocks, generator=gen).to(torch.int32)
    q = torch.randn(new, HEADS, DIM, generator=gen)
    scale = 1 / math.sqrt(DIM)
    tiles = ta.Tiles.prefill(new, prefix + new, "cpu")
    prefill = ta.paged_attention(q, k_pool, v_pool, table[None], tiles, scale, window)
    k = k_pool[table.long()].reshape(-1, KV_HEADS, DIM)
    v = v_pool[table.long()].reshape(-1, KV_HEADS, DIM)
    want = reference(q, k, v, list(range(prefix, prefix + new)), window)
    lens = [prefix + i + 1 for i in range(new)]
    tables = table[None].repeat(new, 1)
    decode_tiles = ta.Tiles.decode(lens, "cpu")
    decode = ta.paged_attention(q, k_pool, v_pool, tables, decode_tiles, scale, window)
    tail_tiles = ta.Tiles.prefill(new - 45, prefix + new, "cpu")
    tail = ta.paged_attention(q[45:], k_pool, v_pool, table[None], tail_tiles, scale, window)
    for name, got, rows in (("prefill", prefill, want), ("decode", decode, want)):
        error = (got.double() - rows).abs().max().item()
        assert error < 1e-5, (window, prefix, name, error)
    error = (tail.double() - want[45:]).abs().max().item()
    assert error < 1e-5, (window, prefix, "another cut", error)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    for window in (None, 1, 20, 37):
        for prefix in (0, 29):
            check(window, prefix)
    from shared.kernels import triton_attention as ta

    try:
        pool = torch.zeros(1, BLOCK, KV_HEADS, DIM)
        one = torch.zeros(1, 1, dtype=torch.int32)
        ta.paged_attention(pool[:1, 0], pool, pool, one, ta.Tiles.decode([1], "cpu"), 1.0, 0)
    except ValueError:
        pass
    else:
        raise AssertionError("a window of 0 tokens was accepted")
    print("ok")


if __name__ == "__main__":
    main()
