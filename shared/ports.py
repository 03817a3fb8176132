"""Binding the ports a service listens on, so that a restart right after a stop works.

A listener that stops leaves its closed connections in TIME_WAIT for a minute;
without ``SO_REUSEADDR`` binding the port again fails meanwhile. With it, only a
socket that really holds the port (another process listening there) refuses the
bind, and that is reported as :class:`PortInUseError`, one line naming the port.
Every listener Baton opens binds this way: the services' HTTP port
(:mod:`shared.service`), the TCP data plane, the UCX listener (``UCX_CM_REUSEADDR``,
checked here first), and redis-server (which sets the option itself).
"""

from __future__ import annotations

import errno
import socket

from shared.errors import ConfigError, PortInUseError


def bind_socket(host: str, port: int, what: str = "") -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEADDR`` (not listening yet).

    Raises :class:`PortInUseError` when another socket holds the port, and
    :class:`ConfigError` for any other refusal (an address not on this host, ...)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio sets TCP_NODELAY on the connections it accepts only when the
    # socket says IPPROTO_TCP (proto 0 does not). Without it a streamed response's
    # first event after its headers waited for the client's delayed ACK: 40 ms of
    # TTFT on every request after the first on a keep-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted ones inherit it
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(port, what) from None
        where = f" ({what})" if what else ""
        raise ConfigError(f"cannot listen on {host}:{port}{where}: {exc.strerror}") from None
    return sock


def listen_socket(host: str, port: int, what: str = "", backlog: int = 2048) -> socket.socket:
    """:func:`bind_socket`, listening: the port is held from here on."""
    sock = bind_socket(host, port, what)
    try:
        sock.listen(backlog)
    except OSError as exc:  # Linux refuses here when another socket listens on the port
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(port, what) from None
        raise
    return sock


def check_port_free(host: str, port: int, what: str = "") -> None:
    """Raise :class:`PortInUseError` if a listener could not bind ``host:port`` now
    (connections in TIME_WAIT do not count). ``port`` 0 is always free."""
    if port:
        listen_socket(host, port, what, backlog=1).close()
