"""The paged KV tensor pool: ``num_blocks`` blocks laid out as :mod:`shared.kv.layout` says.

Ownership: the pool belongs to one model runner; which request owns which
block is the :class:`~shared.kv.block_pool.BlockPool`'s business. The memory
is allocated once at start-up and never grows.
"""

from __future__ import annotations

import math
import mmap

import torch

from shared.kv.layout import KVLayout


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # An anonymous mapping: zero-filled lazily by the OS, so a large pool costs
    # nothing until used (torch.zeros would touch every page now), and page-aligned.
    # numpy.zeros was lazy too but its data starts 16 bytes into a page, which puts
    # every 64-byte K/V row across two cache lines: decode attention ran 2x slower.
    itemsize = torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, math.prod(shape) * itemsize)
    # the tensor holds a reference to the mapping, which lives as long as the pool
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)


PAGE_BYTES = 4096


class KVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: str = "cpu"):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.layout = layout
        self.num_blocks = num_blocks
        self.pool = _zeros((num_blocks, *layout.block_shape), layout.torch_dtype, device)

    @classmethod
    def for_memory(cls, layout: KVLayout, nbytes: int, device: str = "cpu") -> KVCache:
        return cls(layout, max(1, nbytes // layout.block_bytes), device)

    def prefault(self) -> None:
        """Make every page of the pool resident now (one byte written per page), so no
        step or incoming transfer pays first-touch page faults later."""
        if self.pool.device.type != "cpu":
            return
        flat = self.pool.view(-1).view(torch.uint8)
        flat[::PAGE_BYTES].zero_()

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_blocks, block_size, kv_heads, head_dim]`` of layer ``idx``'s K and V."""
        return self.pool[:, idx, 0], self.pool[:, idx, 1]

    def block(self, block_id: int) -> torch.Tensor:
        """One block as its contiguous ``block_shape`` tensor (a view, not a copy)."""
        return self.pool[block_id]
