from __future__ import annotations

import fcntl
import itertools
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.kvstore import shm
from services.kvstore.arena import Arena, Slot

MB = 1 << 20
OUT: dict[str, Any] = {"capture_output": True, "text": True, "check": True, "timeout": 60}


def test_slots_do_not_overlap_and_stay_inside_their_slab() -> None:
    arena = Arena(8 * MB, 2 * MB, pinned=False)
    slots = [arena.allocate(700_000) for _ in range(8)]  # 2 per slab
    assert all(s is not None for s in slots)
    spans = sorted((s.offset, s.offset + s.size) for s in slots if s is not None)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    for start, end in spans:
        assert start // (2 * MB) == (end - 1) // (2 * MB)
    assert arena.allocate(700_000) is None  # 4 slabs x 2 slots
    assert arena.used_bytes == 8 * 700_000


def test_empty_slab_goes_back_for_another_size() -> None:
    arena = Arena(2 * MB, 1 * MB, pinned=False)
    a, b = arena.allocate(600_000), arena.allocate(600_000)
    assert a is not None and b is not None
    assert arena.allocate(300_000) is None
    arena.free(a)
    small = [arena.allocate(300_000) for _ in range(3)]
    assert all(s is not None for s in small)
    arena.free(b)
    assert arena.allocate(1 * MB) is not None


def test_views_address_the_slot() -> None:
    arena = Arena(2 * MB, 1 * MB, pinned=False)
    slot = arena.allocate(1000)
    assert slot is not None
    arena.view(slot)[:] = 7
    assert arena.view(slot, 10, 20).sum() == 70
    assert arena.buffer[slot.offset : slot.offset + 1000].sum() == 7000


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        Arena(MB, 2 * MB, pinned=False)
    arena = Arena(2 * MB, MB, pinned=False)
    with pytest.raises(ValueError):
        arena.allocate(MB + 1)
    with pytest.raises(ValueError):
        arena.allocate(0)
    assert isinstance(arena.allocate(MB), Slot)


def test_a_shared_arena_is_a_private_allocated_file_removed_at_close(tmp_path: Path) -> None:
    arena = Arena(8 * MB, 2 * MB, pinned=False, shared=True, shm_dir=tmp_path)
    path = arena.shm_path
    assert path is not None and path.parent == tmp_path
    assert path.name.startswith(f"{shm.PREFIX}{os.getpid()}-")
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 8 * MB
    assert st.st_blocks * 512 >= 8 * MB  # allocated up front: no page faults mid-copy
    slot = arena.allocate(1000)
    assert slot is not None
    arena.view(slot)[:] = 9
    with open(path, "rb") as f:  # the buffer *is* the file (what clients map)
        f.seek(slot.offset)
        assert f.read(1000) == b"\x09" * 1000
    arena.close()
    assert not path.exists()
    arena.close()  # idempotent


def test_files_of_dead_stores_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], **OUT)
    dead_pid = int(child.stdout)
    dead = tmp_path / f"{shm.PREFIX}{dead_pid}-00ff"
    hidden = tmp_path / f"{shm.PREFIX}{dead_pid}-11ff"  # dead-looking pid, owner alive
    live = tmp_path / f"{shm.PREFIX}{os.getpid()}-22ff"
    other = tmp_path / "someone-elses-file"
    for path in (dead, hidden, live, other):
        path.write_bytes(b"x")
    with open(hidden, "rb") as held:  # its owner's lock: in another pid namespace, say
        fcntl.flock(held, fcntl.LOCK_EX)
        assert shm.remove_dead(tmp_path) == [dead]
    assert {p.name for p in tmp_path.iterdir()} == {hidden.name, live.name, other.name}


def test_a_store_starting_removes_what_a_killed_store_left(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from services.kvstore.arena import Arena\n"
        f"a = Arena({4 * MB}, {MB}, pinned=False, shared=True, shm_dir=Path({str(tmp_path)!r}))\n"
        "print(a.shm_path, flush=True)\n"
        "os._exit(0)  # no cleanup: a crash\n"
    )
    left = Path(subprocess.run([sys.executable, "-c", code], **OUT).stdout.strip())
    assert left.exists()
    arena = Arena(4 * MB, MB, pinned=False, shared=True, shm_dir=tmp_path)
    assert not left.exists() and arena.shm_path is not None and arena.shm_path.exists()
    arena.close()


def test_falls_back_to_private_memory_when_shm_is_too_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = os.statvfs(tmp_path)
    small = os.statvfs_result((real.f_bsize, 4096, 16, 16, 16, 0, 0, 0, 0, 255))
    monkeypatch.setattr(shm.os, "statvfs", lambda _: small)  # a 64 KiB /dev/shm
    arena = Arena(8 * MB, 2 * MB, pinned=False, shared=True, shm_dir=tmp_path)
    assert arena.shm_path is None and list(tmp_path.iterdir()) == []
    assert "not shared" in caplog.text
    slot = arena.allocate(100)
    assert slot is not None
    arena.view(slot)[:] = 1
    arena.close()
