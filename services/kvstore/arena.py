"""The store's memory: one preallocated arena carved into size-class slabs.

Blocks are not Python objects: a block is a :class:`Slot` (offset, size) in one
big buffer allocated at start-up. The arena is cut into fixed *slabs*; a slab
serves one block size (a size class, like memcached's slab allocator), and an
empty slab goes back to the arena so another size can use it. A deployment
has one or two block sizes (model x dtype), so fragmentation is bounded by
one partly-used slab per size.

Memory is, by default, a file in /dev/shm (:mod:`services.kvstore.shm`) so
that clients on the same host can map it and copy block bytes themselves; with
``shared=False``, or when /dev/shm cannot hold it, it is anonymous memory of
this process. Either way pages are zero-filled lazily by the OS. When CUDA is
present the memory is pinned (so a GPU client's copies are DMA): a shared
mapping is registered in place with ``cudaHostRegister`` (pinned memory must
*be* the shared mapping), an anonymous one is a pinned torch tensor.

Ownership: the arena owns its buffer; :meth:`Arena.close` drops it (and
unlinks the file), after which no view handed out may be used.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from services.kvstore.shm import SHM_DIR, ShmFile, ShmUnavailableError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    offset: int
    size: int


@dataclass
class _SizeClass:
    size: int
    slots_per_slab: int
    free: dict[int, list[int]] = field(default_factory=dict)  # slab -> free slot indices
    used: dict[int, int] = field(default_factory=dict)  # slab -> slots in use


def cuda_present() -> bool:
    """A usable CUDA device, without importing torch on hosts that have no driver."""
    if not os.path.exists("/dev/nvidiactl"):
        return False
    import torch

    return bool(torch.cuda.is_available())


def _allocate_buffer(capacity: int, pinned: bool) -> np.ndarray:
    if pinned:
        import torch

        return torch.empty(capacity, dtype=torch.uint8, pin_memory=True).numpy()
    return np.zeros(capacity, dtype=np.uint8)  # calloc: pages appear on first touch


def _register_host(buffer: np.ndarray) -> bool:
    """Pin ``buffer`` in place for CUDA DMA; False (and a log line) if the driver refuses."""
    import torch

    try:
        err = int(torch.cuda.cudart().cudaHostRegister(buffer.ctypes.data, buffer.nbytes, 0))
    except RuntimeError as exc:  # the CUDA runtime itself would not start
        log.warning("cannot pin the shared arena (%s): unpinned", exc)
        return False
    if err != 0:
        log.warning("cudaHostRegister of the shared arena failed (cudaError %d): unpinned", err)
        return False
    return True


def _unregister_host(buffer: np.ndarray) -> None:
    import torch

    err = int(torch.cuda.cudart().cudaHostUnregister(buffer.ctypes.data))
    if err != 0:
        log.warning("cudaHostUnregister of the shared arena failed (cudaError %d)", err)


class Arena:
    def __init__(
        self,
        capacity: int,
        slab_bytes: int,
        *,
        pinned: bool | None = None,
        shared: bool = False,
        shm_dir: Path = SHM_DIR,
    ):
        if slab_bytes <= 0 or capacity < slab_bytes:
            raise ValueError(
                f"the arena needs at least one slab: capacity {capacity}, slab {slab_bytes}"
            )
        self.slab_bytes = slab_bytes
        self.num_slabs = capacity // slab_bytes
        self.capacity = self.num_slabs * slab_bytes
        want_pinned = cuda_present() if pinned is None else pinned
        self.shm: ShmFile | None = None
        if shared:
            try:
                self.shm = ShmFile(self.capacity, shm_dir)
            except ShmUnavailableError as exc:
                log.warning("KV arena not shared with local clients: %s", exc)
        if self.shm is not None:
            self.buffer = np.frombuffer(self.shm.map, dtype=np.uint8)
            self.pinned = want_pinned and _register_host(self.buffer)
            self._host_registered = self.pinned
        else:
            self.buffer = _allocate_buffer(self.capacity, want_pinned)
            self.pinned = want_pinned
            self._host_registered = False
        self._free_slabs = list(range(self.num_slabs - 1, -1, -1))
        self._classes: dict[int, _SizeClass] = {}
        self.used_bytes = 0

    @property
    def max_block_bytes(self) -> int:
        return self.slab_bytes

    @property
    def shm_path(self) -> Path | None:
        """The file same-host clients map, or None when the arena is not shared."""
        return None if self.shm is None else self.shm.path

    def close(self) -> None:
        """Release the memory (unregister, unmap, unlink the file); idempotent.

        Views handed out earlier must be gone: a transfer still running is a bug."""
        if self._host_registered:
            _unregister_host(self.buffer)
            self._host_registered = False
        self.buffer = np.empty(0, dtype=np.uint8)
        if self.shm is not None:
            self.shm.close()

    def allocate(self, size: int) -> Slot | None:
        """A slot of exactly ``size`` bytes, or None when no slab has room."""
        if not 0 < size <= self.slab_bytes:
            raise ValueError(f"block size {size} outside (0, {self.slab_bytes}]")
        cls = self._classes.get(size)
        if cls is None:
            cls = self._classes[size] = _SizeClass(size, self.slab_bytes // size)
        slab = next(iter(cls.free), None)
        if slab is None:
            if not self._free_slabs:
                return None
            slab = self._free_slabs.pop()
            cls.free[slab] = list(range(cls.slots_per_slab - 1, -1, -1))
            cls.used[slab] = 0
        slots = cls.free[slab]
        index = slots.pop()
        if not slots:
            del cls.free[slab]
        cls.used[slab] += 1
        self.used_bytes += size
        return Slot(slab * self.slab_bytes + index * size, size)

    def free(self, slot: Slot) -> None:
        cls = self._classes[slot.size]
        slab, rest = divmod(slot.offset, self.slab_bytes)
        cls.free.setdefault(slab, []).append(rest // slot.size)
        cls.used[slab] -= 1
        self.used_bytes -= slot.size
        if cls.used[slab] == 0:  # whole slab empty: give it back for any size
            del cls.used[slab], cls.free[slab]
            self._free_slabs.append(slab)

    def can_allocate(self, size: int) -> bool:
        cls = self._classes.get(size)
        return bool(self._free_slabs) or (cls is not None and bool(cls.free))

    def view(self, slot: Slot, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Bytes ``[start, stop)`` of the slot, as a view into the arena."""
        end = slot.size if stop is None else stop
        return self.buffer[slot.offset + start : slot.offset + end]
