from __future__ import annotations

import asyncio

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
    futures = [completions.track(r) for r in (ok, bad, slow)]
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


def test_installed_ucxx_has_what_the_driver_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    check_ucxx_internals()
    moved = {"ucxx._lib_async.endpoint.Endpoint": ("no_such_attribute",)}
    monkeypatch.setattr(ucx_progress, "REQUIRED", moved)
    with pytest.raises(ConfigError, match="UCXPY_PROGRESS_MODE"):
        check_ucxx_internals()
