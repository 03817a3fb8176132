"""How the handoff reads a failed connection to an instance."""

from __future__ import annotations

import httpx

from services.gateway.handoff import _dropped_connection


def test_a_dropped_kept_alive_connection_is_not_a_refusal() -> None:
    """A connection the instance closed as it was reused (it is fine: try it again) is
    told apart from one it refused or never answered (bench it, try another)."""
    assert _dropped_connection(httpx.RemoteProtocolError("Server disconnected"))
    assert _dropped_connection(httpx.ReadError(""))
    assert _dropped_connection(httpx.WriteError(""))
    assert not _dropped_connection(httpx.ConnectError("Connection refused"))
    assert not _dropped_connection(httpx.ConnectTimeout(""))
    assert not _dropped_connection(httpx.ReadTimeout(""))
