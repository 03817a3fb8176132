"""Content-addressed block ids.

A full block's id is ``hash_fn(parent id || token ids || extra keys)``. The
extra keys (model identity, dtype, KV layout version, optional per-tenant
``cache_salt``) are folded into the root of every chain, so two tenants or two
layouts never share an id. Only full blocks get an id: a request's partial
tail block is request-scoped.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", bytes)
HashFn = Callable[[bytes], bytes]


def sha256_128(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


@dataclass(frozen=True)
class BlockHasher:
    """Computes chained block ids for one model/layout; ``hash_fn`` must be stable across hosts."""

    namespace: str  # model identity + KV layout description
    block_size: int
    hash_fn: HashFn = sha256_128

    def root(self, cache_salt: str | None = None) -> BlockHash:
        salt = "-" if cache_salt is None else f"{len(cache_salt)}:{cache_salt}"
        extra = f"baton-kv\x00{self.namespace}\x00salt={salt}".encode()
        return BlockHash(self.hash_fn(extra))

    def chain(self, parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
        if len(tokens) != self.block_size:
            raise ValueError(
                f"a block id covers exactly {self.block_size} tokens, got {len(tokens)}"
            )
        return BlockHash(self.hash_fn(parent + struct.pack(f"<{len(tokens)}I", *tokens)))

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        parent: BlockHash | None = None,
        start_block: int = 0,
    ) -> list[BlockHash]:
        """Ids of the full blocks of ``token_ids`` from block ``start_block`` on.

        ``parent`` is the id of block ``start_block - 1`` (or the root when 0).
        """
        prev = self.root(cache_salt) if parent is None else parent
        out: list[BlockHash] = []
        bs = self.block_size
        for i in range(start_block, len(token_ids) // bs):
            prev = self.chain(prev, token_ids[i * bs : (i + 1) * bs])
            out.append(prev)
        return out
