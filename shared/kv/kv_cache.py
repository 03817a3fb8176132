"""The paged KV tensor pool: ``num_blocks`` slots of ``width`` layers each.

With one layer group (:mod:`shared.kv.layer_groups`) a slot is one block laid
out as :mod:`shared.kv.layout` says. With sliding-window layers a block's layers
are spread over its group-0 slot and its window part's slots; the transports
still move blocks in the layout's format, gathered from (and scattered into) the
slots by :meth:`KVCache.gather_blocks` and :meth:`KVCache.scatter_blocks`.

Ownership: the pool belongs to one model runner; which request holds which
slot (and which window part belongs to which block) is the
:class:`~shared.engine.kv_cache_manager.KVCacheManager`'s business, read here
through the lookup :meth:`KVCache.bind_parts` installs. The memory is allocated
once at start-up and never grows.
"""

from __future__ import annotations

import logging
import math
import mmap
import sys
from collections.abc import Callable, Sequence

import torch

from shared.config import HugePages
from shared.errors import ConfigError
from shared.kv.layer_groups import LayerGroups
from shared.kv.layout import KVLayout

PartLookup = Callable[[int], "Sequence[int] | None"]  # a block's slot -> its window part

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
        groups: LayerGroups | None = None,
    ):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.layout = layout
        self.groups = groups if groups is not None else LayerGroups.full(layout.num_layers)
        if self.groups.num_layers != layout.num_layers:
            raise ValueError(
                f"layer groups cover {self.groups.num_layers} layers, not {layout.num_layers}"
            )
        if self.groups.windowed and device != "cpu":
            raise ConfigError("a KV pool split by layer groups is built for CPU pools only")
        self.num_blocks = num_blocks
        self._place = [self.groups.place(i) for i in range(layout.num_layers)]
        self._part_of: PartLookup | None = None
        shape = (num_blocks, self.groups.width, *layout.block_shape[1:])
        self.pool = anonymous_zeros(shape, layout.torch_dtype, device, huge_pages)
        # a block's slot -> its window part's slots (0 where it has none: never read),
        # so a step's block tables translate to each sliding group's by one gather
        self.part_table = torch.zeros(
            (num_blocks if self.groups.windowed else 0, self.groups.num_window_groups),
            dtype=torch.int64,
            device=device,
        )

    @staticmethod
    def slot_bytes(layout: KVLayout, groups: LayerGroups | None = None) -> int:
        width = layout.num_layers if groups is None else groups.width
        return width * layout.layer_bytes

    @classmethod
    def for_memory(
        cls,
        layout: KVLayout,
        nbytes: int,
        device: str = "cpu",
        huge_pages: HugePages = "auto",
        groups: LayerGroups | None = None,
    ) -> KVCache:
        slots = max(1, nbytes // cls.slot_bytes(layout, groups))
        return cls(layout, slots, device, huge_pages, groups)

    @property
    def nbytes(self) -> int:
        """The pool's memory."""
        return self.num_blocks * self.slot_bytes(self.layout, self.groups)

    @property
    def windowed(self) -> bool:
        return self.groups.windowed

    def bind_parts(self, part_of: PartLookup) -> None:
        """Where each block's window part is (the KV cache manager's mapping)."""
        self._part_of = part_of

    def set_part(self, slot: int, part: Sequence[int] | None) -> None:
        """The manager attached ``part`` to the block in ``slot`` (None: detached it)."""
        if part is None:
            self.part_table[slot] = 0
        else:
            self.part_table[slot] = torch.tensor(part, dtype=torch.int64)

    def prefault(self) -> None:
        """Make every page of the pool resident now (one byte written per page), so no
        step or incoming transfer pays first-touch page faults later."""
        if self.pool.device.type != "cpu":
            return
        flat = self.pool.view(-1).view(torch.uint8)
        flat[::PAGE_BYTES].zero_()

    def group_of(self, layer: int) -> int:
        """The layer group holding ``layer`` (0: the one every block has)."""
        return self._place[layer][0]

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_blocks, block_size, kv_heads, head_dim]`` of layer ``idx``'s K and V,
        indexed by the slots of its group."""
        i = self._place[idx][1]
        return self.pool[:, i, 0], self.pool[:, i, 1]

    def block(self, slot: int) -> torch.Tensor:
        """The block in ``slot`` as its contiguous ``block_shape`` tensor (a view; one
        layer group only)."""
        if self.windowed:
            raise RuntimeError("a block of a pool split by layer groups spans several slots")
        return self.pool[slot]

    # -- whole blocks, in the layout's format (any grouping) --------------------------------
    def part_of(self, slot: int) -> Sequence[int] | None:
        return None if self._part_of is None else self._part_of(slot)

    def layer_slot(self, slot: int, layer: int, part: Sequence[int] | None) -> torch.Tensor | None:
        """``[2, block_size, kv_heads, head_dim]``: ``layer`` of the block in ``slot``
        (whose window part is ``part``), in place; None for a sliding layer of a block
        without a part."""
        g, i = self._place[layer]
        if g == 0:
            return self.pool[slot, i]
        return None if part is None else self.pool[part[g - 1], i]

    def gather_blocks(
        self, slots: Sequence[int], parts: Sequence[Sequence[int] | None], out: torch.Tensor
    ) -> None:
        """Copy the blocks in ``slots`` (whose window parts are ``parts``) into ``out``
        (``[n, *block_shape]``, the pool's dtype), one gather and one copy per layer
        group; the sliding layers of a block without a part come out as zeros."""
        idx = torch.tensor(list(slots), dtype=torch.int64, device=self.pool.device)
        missing = [i for i, p in enumerate(parts) if p is None]
        for g, layers in enumerate(self.groups.groups):
            if g == 0:
                pages = idx
            else:
                pages = torch.tensor(
                    [0 if p is None else p[g - 1] for p in parts], dtype=torch.int64
                ).to(self.pool.device)
            src = self.pool.index_select(0, pages)[:, : len(layers)]
            if g and missing:
                src[missing] = 0
            rows = torch.tensor(layers, dtype=torch.int64, device=self.pool.device)
            out.index_copy_(1, rows, src)

    def scatter_blocks(
        self, slots: Sequence[int], parts: Sequence[Sequence[int] | None], src: torch.Tensor
    ) -> None:
        """Copy ``src`` (``[n, *block_shape]``) into the blocks in ``slots`` (whose window
        parts are ``parts``), one gather and one copy per layer group; a block without a
        part keeps only its full-attention layers."""
        device = self.pool.device
        for g, layers in enumerate(self.groups.groups):
            if g == 0:
                at, pages = list(range(len(slots))), list(slots)
            else:
                at = [i for i, p in enumerate(parts) if p is not None]
                pages = [p[g - 1] for p in parts if p is not None]
            if not at:
                continue
            rows = torch.tensor(layers, dtype=torch.int64, device=device)
            picked = src.index_select(0, torch.tensor(at, device=device)).index_select(1, rows)
            self.pool[:, : len(layers)].index_copy_(
                0, torch.tensor(pages, dtype=torch.int64, device=device), picked
            )
