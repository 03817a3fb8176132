"""Block allocator with reference counts and a content-hash prefix cache.

Pure Python, no tensors: it decides which block ids of the KV pool a request
owns. A block is *free* when its reference count is zero; free blocks that
still hold a full, hashed block stay findable by hash (prefix cache) until the
allocator reuses them, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

from shared.kv.block_hash import BlockHash

BlockId = NewType("BlockId", int)


class OutOfBlocksError(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free than asked for."""


@dataclass
class _Block:
    block_id: BlockId
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._blocks = [_Block(BlockId(i)) for i in range(num_blocks)]
        # free blocks in eviction order (least recently freed first)
        self._free: OrderedDict[BlockId, None] = OrderedDict(
            (b.block_id, None) for b in self._blocks
        )
        self._cached: dict[BlockHash, BlockId] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def ref_count(self, block_id: BlockId) -> int:
        return self._blocks[block_id].ref_count

    def allocate(self, n: int) -> list[BlockId]:
        """Take ``n`` free blocks (evicting their cached content); all or nothing."""
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} blocks, {len(self._free)} free")
        out: list[BlockId] = []
        for _ in range(n):
            bid, _unused = self._free.popitem(last=False)
            blk = self._blocks[bid]
            if blk.block_hash is not None:
                del self._cached[blk.block_hash]
                blk.block_hash = None
            blk.ref_count = 1
            out.append(bid)
        return out

    def lookup(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """Longest prefix of ``hashes`` held in the pool (does not take references)."""
        if not self.enable_caching:
            return []
        found: list[BlockId] = []
        for h in hashes:
            bid = self._cached.get(h)
            if bid is None:
                break
            found.append(bid)
        return found

    def acquire(self, block_ids: Iterable[BlockId]) -> None:
        """Take one more reference on each block (a prefix-cache hit)."""
        for bid in block_ids:
            blk = self._blocks[bid]
            if blk.ref_count == 0:
                del self._free[bid]
            blk.ref_count += 1

    def release(self, block_ids: Iterable[BlockId]) -> None:
        """Drop one reference on each block. Give blocks tail-first so a
        sequence's last blocks are evicted before its shared prefix.

        A freed block that holds no cached content is reused first: nothing is
        lost, and its memory is still warm (reusing it avoids touching cold
        pages of the pool)."""
        for bid in block_ids:
            blk = self._blocks[bid]
            if blk.ref_count <= 0:
                raise ValueError(f"block {bid} released more often than acquired")
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self._free[bid] = None
                if blk.block_hash is None:
                    self._free.move_to_end(bid, last=False)

    def cache_full_block(self, block_id: BlockId, block_hash: BlockHash) -> None:
        """Record that ``block_id`` now holds the full block ``block_hash``."""
        if not self.enable_caching:
            return
        blk = self._blocks[block_id]
        if blk.block_hash is not None or block_hash in self._cached:
            return  # already cached (possibly as another physical copy): keep the first
        blk.block_hash = block_hash
        self._cached[block_hash] = block_id
