"""LocalArena: copies between client buffers and a mapped arena file, checked before
any byte moves, and never left running behind a cancelled caller."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.errors import ProtocolError
from shared.kvstore import local_arena
from shared.kvstore.local_arena import LocalArena, host_identity

SIZE = 1 << 20


@pytest.fixture
def arena_file(tmp_path: Path) -> Path:
    path = tmp_path / "arena"
    with open(path, "wb") as f:
        f.truncate(SIZE)
    return path


def test_copies_both_ways_through_the_file(arena_file: Path) -> None:
    arena = LocalArena.open(str(arena_file), SIZE)
    src = np.arange(4096, dtype=np.uint8)
    arena.write_from(src, 8192)
    assert arena_file.read_bytes()[8192 : 8192 + 4096] == src.tobytes()  # MAP_SHARED
    out = torch.zeros(1024, dtype=torch.float32)  # any CPU dtype: bytes are bytes
    arena.read_into(out, 8192)
    assert out.numpy().view(np.uint8).tobytes() == src.tobytes()
    arena.close()


async def test_many_checks_every_buffer_before_copying(arena_file: Path) -> None:
    arena = LocalArena.open(str(arena_file), SIZE)
    await arena.write_many([np.full(100, 7, np.uint8)], [0])
    dst = [np.zeros(100, np.uint8), np.zeros(50, np.uint8)]
    with pytest.raises(ValueError, match="do not match"):
        await arena.read_many(dst, [0, 100], [100, 60])
    assert not dst[0].any()  # refused as a whole: nothing copied
    with pytest.raises(ValueError, match="writable"):
        await arena.read_many([np.zeros(10, np.uint8).data.toreadonly()], [0], [10])
    with pytest.raises(ProtocolError, match="outside"):
        await arena.write_many([np.zeros(10, np.uint8)], [SIZE - 5])
    await arena.read_many(dst[:1], [0], [100])
    assert (dst[0] == 7).all()
    arena.close()
    with pytest.raises(ProtocolError):  # unmapped: no copy can land anywhere
        arena.write_from(np.zeros(1, np.uint8), 0)


def test_open_refuses_what_the_store_did_not_describe(arena_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        LocalArena.open(str(arena_file), SIZE * 2)
    with pytest.raises(OSError):
        LocalArena.open(str(tmp_path / "missing"), SIZE)
    link = tmp_path / "link"
    link.symlink_to(arena_file)
    with pytest.raises(OSError):  # O_NOFOLLOW
        LocalArena.open(str(link), SIZE)


async def test_a_cancelled_large_copy_still_finishes_before_the_caller_moves_on(
    arena_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store unpins a block when the client acks or closes; a copy must never
    outlive the coroutine that started it."""
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []
    real_run = local_arena._run

    def slow_run(copies: list[local_arena._Copy]) -> None:
        started.set()
        release.wait(10)
        real_run(copies)
        finished.append(True)

    monkeypatch.setattr(local_arena, "_run", slow_run)
    monkeypatch.setattr(local_arena, "THREAD_MIN_BYTES", 1)
    arena = LocalArena.open(str(arena_file), SIZE)
    task = asyncio.create_task(arena.write_many([np.ones(SIZE, np.uint8)], [0]))
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.1)
    assert not task.done()  # still waiting for its copy, cancelled or not
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == [True]
    arena.close()


def test_host_identity_is_this_boot_and_hostname() -> None:
    ident = host_identity()
    if not os.path.exists("/proc/sys/kernel/random/boot_id"):
        assert ident is None
        return
    assert ident is not None and ident.endswith("/" + os.uname().nodename)
