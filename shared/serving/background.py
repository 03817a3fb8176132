"""Cleanup that must finish even when the request's task is being cancelled.

A request handler's ``finally`` runs under cancellation when the client goes
away; with anyio (Starlette) cancellation is level-triggered, so every
``await`` there is cancelled again and releasing KV, revoking a put or
closing a worker stream would stop halfway. Such cleanup runs as its own task
instead; :class:`Background` keeps a reference until it is done and lets
shutdown wait for the stragglers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background cleanup %s failed", task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout_s: float = 10.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
