"""The store arena's backing file in /dev/shm, so same-host clients can map it.

One file per store process, named ``baton-kv-<pid>-<random>``: created with
O_EXCL and mode 0600 (only this user's processes can map it), its pages
allocated up front (``posix_fallocate``: about 0.3 s per GiB here), mapped
MAP_SHARED. A sparse file would zero-fill each page at its first touch, in the
middle of a client's copy (a prompt's blocks written at under 2 GB/s while its
next chunk computes); allocated, a client's copies run at memory speed. The
store holds an exclusive ``flock`` on it for its lifetime.

Cleanup: :meth:`ShmFile.close` unmaps and unlinks it (at stop, and at
interpreter exit through a finalizer). A store killed outright cannot do that,
so every new store first removes the files of dead stores: a file whose pid is
not alive *and* whose lock it can take (a lock dies with its process, so this
is right even when a pid namespace hides the owner).

A tmpfs smaller than the arena would kill the store with SIGBUS when it fills
(Docker gives containers 64 MiB of /dev/shm by default), so creation is
refused when /dev/shm has less free space than the arena needs (and the
allocation itself fails, not a later write, if another process took it since).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import weakref
from pathlib import Path

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
PREFIX = "baton-kv-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+$")


class ShmUnavailableError(OSError):
    """No shared arena here: no /dev/shm, too little space in it, or creation failed."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def remove_dead(directory: Path = SHM_DIR) -> list[Path]:
    """Unlink arena files left by stores that died without cleaning up; the paths removed."""
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        found = _NAME.match(name)
        if found is None or _pid_alive(int(found.group(1))):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            log.debug("cannot inspect stale arena file %s: %s", path, exc)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its owner lives (in another pid namespace)
        finally:
            os.close(fd)  # also drops our lock
        with contextlib.suppress(FileNotFoundError):  # another store removed it first
            path.unlink()
            removed.append(path)
    if removed:
        log.info("removed %d arena files of dead KV stores from %s", len(removed), directory)
    return removed


def _release(mm: mmap.mmap, fd: int, path: Path) -> None:
    """Unlink first (new clients can no longer open it), then unmap and close."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    try:
        mm.close()
    except BufferError:  # views still exported; the pages go when they do
        log.debug("arena views still in use at close; the mapping outlives the file")
    os.close(fd)


class ShmFile:
    """A fresh shared arena file of ``size`` bytes, mapped read/write (see module doc)."""

    def __init__(self, size: int, directory: Path = SHM_DIR):
        remove_dead(directory)
        try:
            free = os.statvfs(directory)
        except OSError as exc:
            raise ShmUnavailableError(errno.ENOENT, f"no {directory}: {exc}") from exc
        if free.f_bavail * free.f_frsize < size:
            raise ShmUnavailableError(
                errno.ENOSPC,
                f"{directory} has {free.f_bavail * free.f_frsize >> 20} MiB free, "
                f"the arena needs {size >> 20} MiB",
            )
        self.path = directory / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.size = size
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            raise ShmUnavailableError(exc.errno, f"cannot create {self.path}: {exc}") from exc
        self._finalizer = weakref.finalize(self, _release, self.map, fd, self.path)

    def close(self) -> None:
        """Unlink and unmap; idempotent. Views of :attr:`map` must be dropped first."""
        self._finalizer()
