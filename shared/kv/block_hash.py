"""Block keys: the content address of a full KV block.

A full block's key is ``hash_fn(parent key || token ids)``, chained from a
root that folds in the extra keys (model identity, dtype, KV layout version,
optional per-tenant ``cache_salt``), so two tenants or two layouts never share
a key. Only full blocks get a key: a request's partial tail block is
request-scoped. :meth:`BlockHasher.extend` is the one function that computes
keys; the engine runs it once per request (incrementally, as tokens appear)
and the gateway runs the same function for routing.

A *block key* is never a *slot* (a position in an instance's KV pool).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType

import xxhash

BlockKey = NewType("BlockKey", bytes)
HashFn = Callable[[bytes], bytes]


def sha256_128(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


@dataclass(frozen=True)
class BlockHasher:
    """Computes chained block keys for one model/layout; ``hash_fn`` must be stable
    across hosts (never Python's ``hash``)."""

    namespace: str  # model identity + KV layout description
    block_size: int
    hash_fn: HashFn = sha256_128

    def root(self, cache_salt: str | None = None) -> BlockKey:
        salt = "-" if cache_salt is None else f"{len(cache_salt)}:{cache_salt}"
        extra = f"baton-kv\x00{self.namespace}\x00salt={salt}".encode()
        return BlockKey(self.hash_fn(extra))

    def chain(self, parent: BlockKey, tokens: Sequence[int]) -> BlockKey:
        if len(tokens) != self.block_size:
            raise ValueError(
                f"a block key covers exactly {self.block_size} tokens, got {len(tokens)}"
            )
        return BlockKey(self.hash_fn(parent + struct.pack(f"<{len(tokens)}I", *tokens)))

    def extend(
        self, keys: list[BlockKey], token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[BlockKey]:
        """Append to ``keys`` (the keys of ``token_ids``' first ``len(keys)`` blocks) the
        keys of every further full block of ``token_ids``; returns the appended ones."""
        bs = self.block_size
        prev = keys[-1] if keys else self.root(cache_salt)
        added: list[BlockKey] = []
        for i in range(len(keys), len(token_ids) // bs):
            prev = self.chain(prev, token_ids[i * bs : (i + 1) * bs])
            added.append(prev)
        keys.extend(added)
        return added

    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockKey]:
        """Keys of every full block of ``token_ids``."""
        return self.extend([], token_ids, cache_salt)
