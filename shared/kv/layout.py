"""The byte layout of one KV block, shared by the engine, the store and the transport.

A block holds K and V of ``block_size`` tokens for every layer in one
contiguous buffer, layer-major: ``[num_layers, 2 (K, V), block_size,
num_kv_heads, head_dim]``. One layer's slice of many blocks is therefore one
strided region (stride = ``block_bytes``, length = ``layer_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUT_VERSION = 2

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value is dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer (K and V) of one block."""
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def describe(self) -> str:
        """Stable text naming this layout; part of every block key's extra keys."""
        return (
            f"v{LAYOUT_VERSION}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
            f":B{self.block_size}:{self.dtype}"
        )
