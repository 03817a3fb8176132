"""A same-host KV store node's arena, mapped into this client: the one place where
a client's buffers meet the store's shared memory.

A store node keeps its arena in a /dev/shm file and names it (path, size, host
identity) in the reply to a hello that asks. A client on the same host
(:func:`host_identity` equal) maps it once with :meth:`LocalArena.open` and
then moves block bytes by copying, while the data-plane connection carries only
control messages (see :mod:`shared.kvstore.protocol`, "Same-host clients").

Ownership and when bytes are safe:

- The store owns the arena and decides what lives where. A client may touch
  ``[offset, offset + n)`` only between the store's reply that handed that
  offset out and the client's ``ack`` on the same connection; the store keeps
  those blocks pinned exactly that long (or until the connection breaks). So
  every copy must have *finished* before the ``ack`` is sent or the connection
  closed. :meth:`LocalArena.read_many` / :meth:`LocalArena.write_many` never
  return before their copies finished, not even when their task is cancelled.
- :meth:`read_into`: ``dst`` is written during the call; its bytes are safe to
  use once the call returns.
- :meth:`write_from`: ``src`` is read during the call and may be reused once
  it returns; the caller tells the store (``ack``) only after that.
- The mapping is this object's; :meth:`close` unmaps it. The store unlinking
  the file (it stopped) does not invalidate the mapping: the pages live until
  this client unmaps them.

Buffers are anything :func:`~shared.transport.base.as_bytes_view` accepts
(numpy, memoryview, CPU torch tensors of any dtype). CUDA tensors would be
handled here too (a DMA from the store's pinned mapping); nothing outside this
module converts buffers for local copies.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import mmap
import os
import socket
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.errors import ProtocolError
from shared.transport.base import Buffer, as_bytes_view

log = logging.getLogger(__name__)
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
THREAD_MIN_BYTES = 4 << 20  # smaller copies run inline: a thread hop costs more than they do


@functools.cache
def host_identity() -> str | None:
    """This kernel boot and hostname: equal only for processes that see the same /dev/shm
    (containers have their own hostname). None where there is no boot id (not Linux)."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return None
    return f"{boot}/{socket.gethostname()}" if boot else None


async def _uncancellable(run: Callable[[], None]) -> None:
    """Run ``run`` in a thread and wait until it finished, cancelled or not.

    The store unpins the blocks when told (or when the connection closes), so a
    copy must never be left running behind a cancelled caller. A cancellation
    that arrived meanwhile is re-raised afterwards."""
    future = asyncio.get_running_loop().run_in_executor(None, run)
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)  # raises the copy's own error, if any
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    future.result()  # a copy error, if any


@dataclass(frozen=True)
class _Copy:
    dst: np.ndarray
    src: np.ndarray


def _paired(views: Sequence[memoryview], offsets: Sequence[int]) -> Sequence[int]:
    if len(views) != len(offsets):
        raise ValueError(f"{len(views)} buffers for {len(offsets)} offsets")
    return offsets


def _run(copies: Sequence[_Copy]) -> None:
    for copy in copies:
        np.copyto(copy.dst, copy.src)


async def _copy_all(copies: Sequence[_Copy]) -> None:
    if sum(c.src.nbytes for c in copies) < THREAD_MIN_BYTES:
        _run(copies)  # no await: nothing can interrupt it halfway
    else:  # large: off the event loop (numpy drops the GIL while it copies)
        await _uncancellable(lambda: _run(copies))


class LocalArena:
    """A store node's shared arena mapped read/write into this process (see module doc)."""

    def __init__(self, path: str, mapping: mmap.mmap):
        self.path = path
        self.size = len(mapping)
        self._map = mapping
        self._bytes = np.frombuffer(mapping, dtype=np.uint8)

    @classmethod
    def open(cls, path: str, size: int) -> LocalArena:
        """Map ``path``, which must be a regular file of exactly ``size`` bytes.

        Raises OSError when it cannot be opened or mapped (another host's path,
        another user's file, a store that is gone) and ValueError when it is not
        the file described."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise ValueError(f"{path} is not a {size}-byte file as the store said")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, mapping)

    def _region(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or offset + nbytes > self.size:
            raise ProtocolError(
                f"store offset {offset} (+{nbytes} bytes) is outside its {self.size}-byte arena"
            )
        return self._bytes[offset : offset + nbytes]

    def _reads(
        self, dsts: Sequence[Buffer], offsets: Sequence[int], sizes: Sequence[int] | None
    ) -> list[_Copy]:
        """The copies into ``dsts``, every buffer checked before any byte moves."""
        views = [as_bytes_view(d) for d in dsts]
        got = [v.nbytes for v in views]
        if sizes is not None and got != list(sizes):
            raise ValueError(f"receive buffers {got[:8]}... do not match the blocks {sizes[:8]}...")
        if any(v.readonly for v in views):
            raise ValueError("receive buffers must be writable")
        return [
            _Copy(np.frombuffer(v, dtype=np.uint8), self._region(o, v.nbytes))
            for v, o in zip(views, _paired(views, offsets), strict=True)
        ]

    def _writes(self, srcs: Sequence[Buffer], offsets: Sequence[int]) -> list[_Copy]:
        views = [as_bytes_view(s) for s in srcs]
        return [
            _Copy(self._region(o, v.nbytes), np.frombuffer(v, dtype=np.uint8))
            for v, o in zip(views, _paired(views, offsets), strict=True)
        ]

    def read_into(self, dst: Buffer, offset: int) -> None:
        """Copy ``len(dst)`` bytes at ``offset`` into ``dst``; safe to use when this returns."""
        _run(self._reads([dst], [offset], None))

    def write_from(self, src: Buffer, offset: int) -> None:
        """Copy all of ``src`` to ``offset``; ``src`` is free again when this returns."""
        _run(self._writes([src], [offset]))

    async def read_many(
        self, dsts: Sequence[Buffer], offsets: Sequence[int], sizes: Sequence[int] | None = None
    ) -> None:
        """:meth:`read_into` for each pair; ``sizes``: what the store said each block is.

        Raises ValueError, before copying anything, if the buffers do not fit.
        Returns only once every copy finished (see :func:`_uncancellable`)."""
        await _copy_all(self._reads(dsts, offsets, sizes))

    async def write_many(self, srcs: Sequence[Buffer], offsets: Sequence[int]) -> None:
        """:meth:`write_from` for each pair; returns only once every copy finished."""
        await _copy_all(self._writes(srcs, offsets))

    def close(self) -> None:
        """Unmap; later copies fail. Call only when no copy runs."""
        self._bytes = np.empty(0, dtype=np.uint8)
        self.size = 0
        try:
            self._map.close()
        except BufferError:  # a view escaped; the mapping goes when it does
            log.debug("views of %s still in use; unmapped when they go", self.path)
