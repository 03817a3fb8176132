"""Replication watermarks: how much of a running request's KV is safely in the store.

Per in-flight decode request one Redis key, ``<prefix>:wm:<request id>``,
holds a JSON record: the decode instance, how many leading tokens' KV the store
holds, and the store ids of those blocks (one per full block, in order). Decode
advances it (one atomic SET) each time a block it replicated is committed; the
gateway reads it when that decode instance dies or drains, and the next
instance loads those blocks instead of recomputing them. The key expires on
its own (TTL, refreshed on every advance); Redis being down only costs the
resume some recompute.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from pydantic import BaseModel, ValidationError
from redis.exceptions import RedisError

from shared.cluster.keys import Keys

log = logging.getLogger(__name__)


class Watermark(BaseModel):
    instance_id: str
    tokens: int  # leading tokens whose KV is committed in the store
    block_ids: list[str]  # the store id of each of those blocks


class Watermarks:
    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: float = 600.0):
        self.redis = redis
        self.keys = keys
        self.ttl_ms = int(ttl_s * 1000)

    async def advance(
        self, request_id: str, instance_id: str, tokens: int, block_ids: Sequence[str]
    ) -> bool:
        """Record ``tokens`` as stored; False (logged once per call) while Redis is down."""
        mark = Watermark(instance_id=instance_id, tokens=tokens, block_ids=list(block_ids))
        try:
            await self.redis.set(
                self.keys.watermark(request_id), mark.model_dump_json(), px=self.ttl_ms
            )
        except (RedisError, OSError) as exc:
            log.warning("watermark of %s not recorded: %s", request_id, exc)
            return False
        return True

    async def read(self, request_id: str) -> Watermark | None:
        """The last recorded watermark; None when there is none or Redis is down."""
        try:
            raw = await self.redis.get(self.keys.watermark(request_id))
        except (RedisError, OSError) as exc:
            log.warning("watermark of %s unreadable: %s", request_id, exc)
            return None
        if raw is None:
            return None
        try:
            return Watermark.model_validate_json(raw)
        except ValidationError:
            log.warning("ignoring a malformed watermark of %s", request_id)
            return None

    async def drop(self, request_id: str) -> None:
        try:
            await self.redis.delete(self.keys.watermark(request_id))
        except (RedisError, OSError) as exc:  # it expires by itself
            log.debug("watermark of %s not deleted: %s", request_id, exc)
