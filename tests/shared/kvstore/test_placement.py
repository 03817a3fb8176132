from __future__ import annotations

from dataclasses import dataclass

from shared.kvstore.placement import rank, replicas


@dataclass(frozen=True)
class Node:
    instance_id: str


NODES = [Node(f"kvstore-{i}") for i in range(5)]
IDS = [f"{i:032x}" for i in range(2000)]


def test_ranking_is_deterministic_and_order_independent() -> None:
    for block_id in IDS[:50]:
        assert rank(block_id, NODES) == rank(block_id, list(reversed(NODES)))


def test_replicas_are_distinct_and_spread() -> None:
    firsts = [replicas(i, NODES, 2)[0].instance_id for i in IDS]
    assert all(len(set(replicas(i, NODES, 2))) == 2 for i in IDS[:100])
    counts = {n.instance_id: firsts.count(n.instance_id) for n in NODES}
    assert min(counts.values()) > 0.6 * len(IDS) / len(NODES)


def test_losing_a_node_only_moves_its_blocks() -> None:
    gone = NODES[2]
    rest = [n for n in NODES if n != gone]
    for block_id in IDS[:300]:
        before = rank(block_id, NODES)
        after = rank(block_id, rest)
        assert after == [n for n in before if n != gone]  # survivors keep their order


def test_one_node_or_none_ranks_without_hashing() -> None:
    assert rank(IDS[0], NODES[:1]) == NODES[:1] and rank(IDS[0], []) == []
    assert rank(IDS[0], NODES[:2]) in (NODES[:2], NODES[1::-1])
