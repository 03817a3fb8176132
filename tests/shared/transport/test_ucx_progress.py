from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from shared.errors import ConfigError
from shared.transport import ucx_progress
from shared.transport.ucx_progress import Completions, check_ucxx_internals


class FakeRequest:
    """Stands in for a UCXX request: a completion flag and an optional error."""

    def __init__(self) -> None:
        self.completed = False
        self.error: Exception | None = None

    def check_error(self) -> None:
        if self.error is not None:
            raise self.error


async def test_futures_complete_only_after_their_request() -> None:
    completions = Completions()
    ok, bad, slow = FakeRequest(), FakeRequest(), FakeRequest()
    posted = [completions.track(r, bytearray(8)) for r in (ok, bad, slow)]
    futures = [p.result for p in posted]
    completions.check()
    assert not any(f.done() for f in futures)
    ok.completed = True
    bad.completed, bad.error = True, ConnectionResetError("peer gone")
    completions.check()
    assert futures[0].result() is None
    with pytest.raises(ConnectionResetError):
        futures[1].result()
    assert not futures[2].done()
    futures[2].cancel()  # a cancelled waiter is skipped, not resolved
    slow.completed = True
    completions.check()
    await asyncio.sleep(0)
    assert futures[2].cancelled()
    assert all(p.settled.done() for p in posted)


async def test_a_buffer_is_held_until_ucx_lets_go_of_it() -> None:
    """A receive whose waiter was cancelled keeps its buffer alive (UCX may still
    write into it) until the request completes; then the buffer is released."""
    completions = Completions()
    request = FakeRequest()
    buffer = bytearray(64)
    alive = weakref.WeakValueDictionary[str, object]()
    holder = Holder(buffer)
    alive["buffer"] = holder
    posted = completions.track(request, holder)
    posted.result.cancel()
    del holder
    completions.check()
    gc.collect()
    assert "buffer" in alive and not posted.settled.done()
    request.completed = True
    completions.check()
    assert posted.settled.done()
    del posted
    gc.collect()
    assert "buffer" not in alive


class Holder:
    """A weak-referenceable stand-in for a receive buffer."""

    def __init__(self, data: bytearray):
        self.data = data


def test_installed_ucxx_has_what_the_driver_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    check_ucxx_internals()
    moved = {"ucxx._lib_async.endpoint.Endpoint": ("no_such_attribute",)}
    monkeypatch.setattr(ucx_progress, "REQUIRED", moved)
    with pytest.raises(ConfigError, match="UCXPY_PROGRESS_MODE"):
        check_ucxx_internals()
