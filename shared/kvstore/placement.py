"""Which store nodes hold a block: rendezvous (highest-random-weight) hashing.

Every client computes the same ranking from the same live node list, with no
coordination; when a node leaves, only the blocks it ranked first for move.
The first ``replication`` nodes of the ranking get the writes; reads try the
ranking in order, so a dead holder falls back to the next replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import xxhash


class HasInstanceId(Protocol):
    @property
    def instance_id(self) -> str: ...


N = TypeVar("N", bound=HasInstanceId)


def rank(block_id: str, nodes: Sequence[N]) -> list[N]:
    """``nodes`` ordered by preference for ``block_id`` (deterministic, stable)."""
    if len(nodes) < 2:
        return list(nodes)  # no hash to take: a put of 512 blocks to one node saves ~1 ms
    return sorted(
        nodes,
        key=lambda n: (
            xxhash.xxh64_intdigest(f"{n.instance_id}\x00{block_id}".encode()),
            n.instance_id,
        ),
        reverse=True,
    )


def replicas(block_id: str, nodes: Sequence[N], replication: int) -> list[N]:
    return rank(block_id, nodes)[: max(1, replication)]
