"""Data-plane transports: UCX through UCXX (default) and plain asyncio TCP (fallback)."""

from __future__ import annotations

from typing import Literal

from shared.errors import ConfigError
from shared.transport.base import Connection, Frame, Listener, Transport

TransportName = Literal["ucx", "tcp"]


def make_transport(name: str) -> Transport:
    """The process's transport; create once at start-up and inject it."""
    if name == "tcp":
        from shared.transport.tcp import TcpTransport

        return TcpTransport()
    if name == "ucx":
        try:
            from shared.transport.ucx import UcxTransport
        except ImportError as exc:
            raise ConfigError(
                f"the UCX transport needs the ucxx package (pip install ucxx-cu12): {exc}"
            ) from exc
        return UcxTransport()
    raise ConfigError(f"unknown transport {name!r}: use 'ucx' or 'tcp'")


__all__ = ["Connection", "Frame", "Listener", "Transport", "TransportName", "make_transport"]
