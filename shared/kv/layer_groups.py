"""Which pool slots hold which layers' K/V: the pool's layer groups.

Every pool slot has room for ``width`` layers of one block. A model whose layers
all attend to every earlier token has one group, all its layers: a block is one
slot, as in :mod:`shared.kv.layout`. A model with sliding-window layers (Gemma 3:
five of every six attend to their last 512 tokens only) splits them: group 0,
its full-attention layers, holds every block of a request; each further group
holds ``width`` sliding layers, and only for the blocks some row still to be
computed can read. A block inside the window takes ``num_groups`` slots, one
outside it takes one, so a long request holds about the window's worth of its
sliding layers, not its whole context (vLLM's hybrid KV cache manager works
alike: every group's pages come from one shared pool).

Slots of all groups are alike (same size, one free list), so memory moves
between the groups as the requests' lengths change. The last group is padded
when the sliding layers do not divide evenly by the width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerGroups:
    groups: tuple[tuple[int, ...], ...]  # group 0: full-attention layers; then sliding
    window: int | None = None  # tokens the sliding groups' layers attend to

    @classmethod
    def full(cls, num_layers: int) -> LayerGroups:
        """One group: every layer, every block."""
        return cls((tuple(range(num_layers)),))

    @classmethod
    def split(cls, windows: Sequence[int | None]) -> LayerGroups:
        """Groups for layers with these windows (None: full attention). Without both
        kinds of layer (or with more than one window size) it is one group."""
        full = tuple(i for i, w in enumerate(windows) if w is None)
        sliding = [i for i, w in enumerate(windows) if w is not None]
        sizes = {w for w in windows if w is not None}
        if not full or not sliding or len(sizes) != 1:
            return cls.full(len(windows))
        width = len(full)
        chunks = [tuple(sliding[i : i + width]) for i in range(0, len(sliding), width)]
        return cls((full, *chunks), sizes.pop())

    @property
    def width(self) -> int:
        """Layers one slot holds."""
        return len(self.groups[0])

    @property
    def num_layers(self) -> int:
        return sum(len(g) for g in self.groups)

    @property
    def num_window_groups(self) -> int:
        """Slots a block inside the window takes beyond its group-0 slot."""
        return len(self.groups) - 1

    @property
    def windowed(self) -> bool:
        return self.num_window_groups > 0

    def place(self, layer: int) -> tuple[int, int]:
        """(group, index inside a slot) of ``layer``."""
        for g, layers in enumerate(self.groups):
            if layer in layers:
                return g, layers.index(layer)
        raise ValueError(f"layer {layer} is in no group")

    def window_bytes_per_token(self, bytes_per_token: int) -> int:
        """Of a token's ``bytes_per_token`` KV bytes, the sliding layers' (0: none)."""
        if not self.windowed:
            return 0
        return bytes_per_token * (self.num_layers - self.width) // self.num_layers

    def describe(self) -> str:
        if not self.windowed:
            return f"{self.num_layers} layers, every block"
        return (
            f"{self.width} full-attention layers for every block, "
            f"{self.num_layers - self.width} sliding-window layers ({self.window} tokens) "
            f"in {self.num_window_groups} groups for the window's blocks only"
        )


def load_bytes(
    tokens: int,
    bytes_per_token: int,
    block_size: int,
    window: int = 0,
    window_bytes_per_token: int = 0,
) -> int:
    """KV bytes a load of a ``tokens``-token prefix moves into a pool that keeps its
    sliding layers (``window_bytes_per_token`` of each token's bytes) only for the
    ``window`` tokens the next row reads: every layer of those (and a block more, the
    row back and the partial ends), the full-attention layers of the rest (see
    ``shared.kvstore.pool_copies.Gathered.landing``). ``window`` 0: every layer."""
    if not window:
        return tokens * bytes_per_token
    windowed = min(tokens, window + block_size)
    return tokens * (bytes_per_token - window_bytes_per_token) + windowed * window_bytes_per_token
