"""Test helper: paged K/V pools laid out as the engine's."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    """Attention geometry of a test case (defaults: the default model's)."""

    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16


DEFAULT_SHAPE = Shape()


def layer_pools(
    shape: Shape, num_blocks: int, dtype: torch.dtype, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's random K and V views (``[blocks, block_size, kv_heads, head_dim]``)
    of a 3-layer pool, so blocks are strided as in the engine's."""
    s = shape
    pool = torch.randn(num_blocks, 3, 2, s.block_size, s.kv_heads, s.head_dim, generator=g)
    pool = pool.to(dtype)
    return pool[:, 1, 0], pool[:, 1, 1]
