"""The one way a Baton process opens its long-lived Redis client.

Short socket timeouts (a dead Redis is noticed in seconds, not minutes), and a
command that fails on a broken connection is sent again once or twice on that
connection reconnected. After a Redis restart every pooled connection is stale:
as ``from_url`` configures the client by default, the first command on each
failed with "Connection closed by server" (a reattach right after a restart
answered 503). A Redis that is down still fails a command within milliseconds
(connections are refused, and the retries wait 10 and 20 ms).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

SOCKET_TIMEOUT_S = 2.0
RETRIES = 2


def connect(url: str) -> aioredis.Redis:
    """A client for ``url``, created once (in a lifespan) and shared."""
    return aioredis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=SOCKET_TIMEOUT_S,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), RETRIES),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
