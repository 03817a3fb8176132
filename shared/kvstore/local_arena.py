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
(numpy, memoryview, CPU torch tensors of any dtype), and contiguous CUDA
tensors: those move by DMA between the device and the mapping, which is
registered with CUDA (pinned) in this process at the first such copy
(:class:`~shared.kvstore.device_buffers.DeviceDMA`); nothing outside this
module converts buffers for local copies.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ProtocolError
from shared.kvstore.device_buffers import DeviceDMA, flat_bytes, is_device, nbytes, uncancellable
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
        await uncancellable(lambda: _run(copies))


class LocalArena:
    """A store node's shared arena mapped read/write into this process (see module doc)."""

    def __init__(self, path: str, mapping: mmap.mmap):
        self.path = path
        self.size = len(mapping)
        self._map = mapping
        self._bytes = np.frombuffer(mapping, dtype=np.uint8)
        self._dma = DeviceDMA()
        self._tensor: Any = None  # the mapping as a torch tensor, once a CUDA copy needs it
        self._registered = False

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
            # page tables filled now (~0.4 s per GiB), not one fault per page mid-copy
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
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
        CUDA tensors among ``dsts`` are filled by DMA.

        Raises ValueError, before copying anything, if the buffers do not fit.
        Returns only once every copy finished (see
        :func:`~shared.kvstore.device_buffers.uncancellable`)."""
        _paired(dsts, offsets)
        if sizes is not None and [nbytes(d) for d in dsts] != list(sizes):
            got = [nbytes(d) for d in dsts]
            raise ValueError(f"receive buffers {got[:8]}... do not match the blocks {sizes[:8]}...")
        device = [(d, o) for d, o in zip(dsts, offsets, strict=True) if is_device(d)]
        host = [(d, o) for d, o in zip(dsts, offsets, strict=True) if not is_device(d)]
        copies = self._reads([d for d, _ in host], [o for _, o in host], None)
        pairs = [(b, a) for a, b in self._device_runs(device)]
        await _copy_all(copies)
        await self._dma.copy(pairs)

    async def write_many(self, srcs: Sequence[Buffer], offsets: Sequence[int]) -> None:
        """:meth:`write_from` for each pair (CUDA tensors by DMA); returns only once every
        copy finished."""
        _paired(srcs, offsets)
        device = [(s, o) for s, o in zip(srcs, offsets, strict=True) if is_device(s)]
        host = [(s, o) for s, o in zip(srcs, offsets, strict=True) if not is_device(s)]
        copies = self._writes([s for s, _ in host], [o for _, o in host])
        pairs = self._device_runs(device)
        await _copy_all(copies)
        await self._dma.copy(pairs)

    def _device_runs(self, device: Sequence[tuple[Buffer, int]]) -> list[tuple[Any, Any]]:
        """``(arena bytes, device bytes)`` per run of CUDA buffers that continue one
        another in device memory while their offsets continue in the arena (consecutive
        pool slots to consecutive arena slots): one DMA each, and Python's per-block
        work cut to reading two integers."""
        runs: list[tuple[Any, int, int]] = []  # (first buffer, offset, bytes)
        end_ptr = end_offset = -1
        storage = None
        for buf, offset in device:
            size, ptr = nbytes(buf), buf.data_ptr()
            here = buf.untyped_storage().data_ptr()
            if runs and ptr == end_ptr and offset == end_offset and here == storage:
                first, start, total = runs[-1]
                runs[-1] = (first, start, total + size)
            else:
                runs.append((buf, offset, size))
                storage = here
            end_ptr, end_offset = ptr + size, offset + size
        import torch

        return [
            (
                self._device_region(offset, total),
                torch.as_strided(flat_bytes(first), (total,), (1,)),
            )
            for first, offset, total in runs
        ]

    def _device_region(self, offset: int, size: int) -> Any:
        """Bytes ``[offset, offset + size)`` of the mapping as a CPU tensor a CUDA copy can
        DMA from or to: the mapping is registered (pinned) with CUDA once, here."""
        self._region(offset, size)  # bounds
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(self._map, dtype=torch.uint8)
            code = torch.cuda.cudart().cudaHostRegister(self._tensor.data_ptr(), self.size, 0)
            self._registered = int(code) == 0
            if not self._registered:  # still correct, at pageable-copy speed
                log.warning("could not pin %s for DMA (CUDA error %s)", self.path, int(code))
        return self._tensor[offset : offset + size]

    def close(self) -> None:
        """Unmap; later copies fail. Call only when no copy runs."""
        if self._tensor is not None:
            if self._registered:
                import torch

                torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
            self._tensor = None
        self._bytes = np.empty(0, dtype=np.uint8)
        self.size = 0
        try:
            self._map.close()
        except BufferError:  # a view escaped; the mapping goes when it does
            log.debug("views of %s still in use; unmapped when they go", self.path)
