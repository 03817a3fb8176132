"""The paged KV tensor pool: ``num_blocks`` blocks laid out as :mod:`shared.kv.layout` says.

Ownership: the pool belongs to one model runner; which request holds which
slot is the :class:`~shared.engine.kv_cache_manager.KVCacheManager`'s business. The memory
is allocated once at start-up and never grows.
"""

from __future__ import annotations

import logging
import math
import mmap
import sys

import torch

from shared.config import HugePages
from shared.errors import ConfigError
from shared.kv.layout import KVLayout

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)  # Linux's value; Python 3.11 lacks the name


def _anonymous(nbytes: int, huge_pages: HugePages) -> mmap.mmap:
    """A zero-filled, page-aligned anonymous mapping of at least ``nbytes``.

    A layer's K/V sit in every block, so decode attention reads 12-24 KB runs
    scattered over the whole pool: with 4 KB pages nearly every run is a TLB
    miss, and the hardware prefetchers stop at each page boundary. 2 MB pages
    the host has reserved (``vm.nr_hugepages``) make batch-32/64 decode steps
    up to 7% shorter here (``benchmarks/huge_pages_bench.py``). ``auto`` takes
    them when enough are free and falls back to ordinary pages (asking for
    transparent huge pages, which hosts that enable them for ``madvise``
    grant); ``on`` fails without them; ``off`` never asks.
    """
    if huge_pages != "off" and sys.platform == "linux":
        rounded = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB
        try:
            return mmap.mmap(-1, rounded, flags=flags)
        except OSError as e:
            if huge_pages == "on":
                raise ConfigError(
                    f"no {rounded >> 20} MiB of reserved 2 MB huge pages for the KV pool "
                    f"(see vm.nr_hugepages): {e}"
                ) from e
            log.info(
                "KV pool: transparent huge pages where the kernel grants them (no 2 MB "
                "pages reserved; `sysctl vm.nr_hugepages=N` makes large decode batches "
                "up to 7%% faster)"
            )
    # private: transparent huge pages apply to private anonymous memory (for shared
    # memory most kernels never grant them)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages != "off" and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


def anonymous_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, huge_pages: HugePages
) -> torch.Tensor:
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # An anonymous mapping: zero-filled lazily by the OS, so a large pool costs
    # nothing until used (torch.zeros would touch every page now), and page-aligned.
    # numpy.zeros was lazy too but its data starts 16 bytes into a page, which puts
    # every 64-byte K/V row across two cache lines: decode attention ran 2x slower.
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    mapping = _anonymous(nbytes, huge_pages)
    # the tensor holds a reference to the mapping, which lives as long as the pool
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


PAGE_BYTES = 4096


class KVCache:
    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: str = "cpu",
        huge_pages: HugePages = "auto",
    ):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.layout = layout
        self.num_blocks = num_blocks
        self.pool = anonymous_zeros(
            (num_blocks, *layout.block_shape), layout.torch_dtype, device, huge_pages
        )

    @classmethod
    def for_memory(
        cls, layout: KVLayout, nbytes: int, device: str = "cpu", huge_pages: HugePages = "auto"
    ) -> KVCache:
        return cls(layout, max(1, nbytes // layout.block_bytes), device, huge_pages)

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

    def block(self, slot: int) -> torch.Tensor:
        """The block in ``slot`` as its contiguous ``block_shape`` tensor (a view)."""
        return self.pool[slot]
