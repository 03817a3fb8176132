"""Where a prompt's KV already is: its block keys looked up in the prompt index.

The gateway computes a prompt's block keys with the workers' own function
(:meth:`BlockHasher.extend`, over the KV namespace and block size they
register) and asks the index who holds each block. Two answers come back:
how many leading tokens each prefill/decode instance holds in its own pool,
and how many the KV store holds (blocks of one prefix sit on different store
nodes, and any instance can pull them). Only live holders count, and only the
blocks a prefill may reuse: the last prompt token is always computed. An
instance whose pool keeps its sliding layers' KV only for the blocks a window
reads counts a prefix only as far as the window of its next row has every
block's window entry too (see :func:`shared.cluster.block_index.window_entry`);
the store keeps every layer of its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from shared.cluster.block_index import BlockIndex, window_entry
from shared.cluster.in_flight import InFlightIndex, in_flight_prefixes
from shared.kv.block_hash import BlockHasher

log = logging.getLogger(__name__)
STORE_ROLE = "kvstore"


@dataclass(frozen=True)
class PrefixHits:
    """Leading prompt tokens whose KV is held: per instance in its own pool, and in the
    store (pullable by every instance)."""

    local: Mapping[str, int] = field(default_factory=dict)
    store: int = 0
    # the keys (hex) of every full block of the prompt: what it leaves cached once computed
    keys: tuple[str, ...] = ()
    # per instance, leading tokens a prompt routed there (by any gateway) is computing
    computing: Mapping[str, int] = field(default_factory=dict)

    def cached(self, instance_id: str) -> int:
        """Tokens ``instance_id`` would not compute: its own blocks, or pulled ones."""
        return max(self.local.get(instance_id, 0), self.store)

    def with_local(self, extra: Mapping[str, int]) -> PrefixHits:
        """These hits with more local holdings (tokens per instance) folded in."""
        local = dict(self.local)
        for iid, tokens in extra.items():
            local[iid] = max(local.get(iid, 0), tokens)
        return PrefixHits(local, self.store, self.keys, self.computing)


NO_HITS = PrefixHits()


class PrefixLocator:
    def __init__(self, index: BlockIndex, *, enabled: bool, in_flight: InFlightIndex | None = None):
        self.index = index
        self.enabled = enabled
        self.in_flight = in_flight  # prompts other gateways routed, and still computing
        self._hasher: BlockHasher | None = None

    def hasher(self, namespace: str, block_size: int) -> BlockHasher:
        h = self._hasher
        if h is None or h.namespace != namespace or h.block_size != block_size:
            h = self._hasher = BlockHasher(namespace=namespace, block_size=block_size)
        return h

    async def locate(
        self,
        prompt: Sequence[int],
        cache_salt: str | None,
        *,
        namespace: str | None,
        block_size: int | None,
        live: Mapping[str, str],
        windows: Mapping[str, int] | None = None,
    ) -> PrefixHits:
        """``live``: instance id -> role of every live instance; ``windows``: instance id
        -> sliding window (tokens) of those that keep only the window's KV."""
        if not self.enabled or namespace is None or not block_size:
            return NO_HITS
        usable = (len(prompt) - 1) // block_size  # the last prompt token is always computed
        ids = tuple(k.hex() for k in self.hasher(namespace, block_size).keys(prompt, cache_salt))
        if usable <= 0:
            return PrefixHits(keys=ids)
        windows = {k: v for k, v in (windows or {}).items() if k in live}
        asked = list(ids[:usable])
        if windows:  # the window entries of every block, held or not
            holders = self.index.holders(asked + [window_entry(i) for i in asked])
        else:  # a prefix ends at the first block nobody holds
            holders = self.index.prefix_holders(asked)
        try:
            rows, computing = await asyncio.gather(holders, self._computing(ids[:usable]))
        except (RedisError, OSError) as exc:  # degraded: route without cache locality
            log.warning("prompt index unreachable; routing without it: %s", exc)
            return PrefixHits(keys=ids)
        found = hits_from_holders(
            rows[:usable], live, block_size, windows, rows[usable:] if windows else None
        )
        workers = {iid for iid, role in live.items() if role != STORE_ROLE}
        blocks = in_flight_prefixes(computing, workers)
        return PrefixHits(
            found.local, found.store, ids, {k: v * block_size for k, v in blocks.items()}
        )

    async def _computing(self, ids: Sequence[str]) -> list[set[str]]:
        return await self.in_flight.computing(ids) if self.in_flight is not None else []


def hits_from_holders(
    rows: Sequence[set[str]],
    live: Mapping[str, str],
    block_size: int,
    windows: Mapping[str, int] | None = None,
    window_rows: Sequence[set[str]] | None = None,
) -> PrefixHits:
    """Per live worker its longest held prefix (cut, for a worker in ``windows``, where
    ``window_rows`` lack it: see :func:`window_cut`); for the store, the longest prefix
    every block of which some live store node holds."""
    local: dict[str, int] = {}
    store = 0
    store_run = True
    running: set[str] | None = None
    for pos, holders in enumerate(rows):
        holders = {h for h in holders if h in live}
        if store_run and any(live[h] == STORE_ROLE for h in holders):
            store = pos + 1
        else:
            store_run = False
        workers = {h for h in holders if live[h] != STORE_ROLE}
        running = workers if running is None else running & workers
        for holder in running:
            local[holder] = pos + 1
        if not running and not store_run:
            break
    for holder, window in (windows or {}).items():
        if holder in local and window_rows is not None:
            local[holder] = window_cut(local[holder], window, block_size, holder, window_rows)
    return PrefixHits({k: v * block_size for k, v in local.items() if v}, store * block_size)


def window_cut(
    blocks: int, window: int, block_size: int, holder: str, rows: Sequence[set[str]]
) -> int:
    """The longest of the first ``blocks`` blocks that ``holder`` can reuse when its
    sliding layers keep only their ``window`` tokens: every block the next row's window
    reads (one row back) has its window entry, as the KV cache manager's own local hit
    cuts it (:meth:`KVCacheManager.window_first`). An upper bound still: a prefill
    instance also stops about a window past the first block the store lacks (it must
    send that block's every layer, :meth:`KVConnector.window_hold`), which the index
    does not say."""
    while blocks:
        first = max(0, blocks * block_size - window) // block_size
        missing = [i for i in range(first, blocks) if holder not in rows[i]]
        if not missing:
            return blocks
        blocks = missing[-1]
    return 0
