"""Plain asyncio TCP transport: the fallback behind the same interface as UCX.

Zero-copy where the kernel allows: segments are sent straight from the
caller's buffers and received straight into the caller's buffers
(``sock_recv_into``); only the small preamble is built per frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Sequence

from shared.errors import PeerLostError, ProtocolError, TransportTimeoutError
from shared.ports import listen_socket
from shared.transport.base import (
    PREAMBLE,
    Buffer,
    Connection,
    Frame,
    Handler,
    Listener,
    Transport,
    as_bytes_view,
    check_into,
    decode_preamble,
    decode_sizes,
    encode_preamble,
)

log = logging.getLogger(__name__)
SOCKET_BUFFER_BYTES = 4 << 20
IOV_MAX = 512  # Linux allows 1024 iovecs per call


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
    sock.setblocking(False)


class TcpConnection(Connection):
    def __init__(self, sock: socket.socket, peer: str):
        _tune(sock)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self.peer = peer

    @property
    def closed(self) -> bool:
        return self._closed

    def _lost(self, why: str) -> PeerLostError:
        self._shutdown()
        return PeerLostError(f"connection to {self.peer} lost: {why}")

    async def _ready(self, writing: bool) -> None:
        """Wait until the socket is writable/readable (one event-loop callback)."""
        fut = self._loop.create_future()
        fd = self._sock.fileno()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        if writing:
            self._loop.add_writer(fd, wake)
        else:
            self._loop.add_reader(fd, wake)
        try:
            await fut
        finally:
            if writing:
                self._loop.remove_writer(fd)
            else:
                self._loop.remove_reader(fd)

    async def _io(self, views: list[memoryview], writing: bool) -> None:
        """Move all of ``views`` with scatter/gather syscalls (sendmsg / recvmsg_into)."""
        if self._closed:
            raise PeerLostError(f"connection to {self.peer} is closed")
        views = [v for v in views if v.nbytes]
        try:
            while views:
                batch = views[:IOV_MAX]
                try:
                    n = self._sock.sendmsg(batch) if writing else self._sock.recvmsg_into(batch)[0]
                except (BlockingIOError, InterruptedError):
                    await self._ready(writing)
                    continue
                if n == 0 and not writing:
                    raise self._lost("closed by peer")
                while n:
                    head = views[0]
                    if n < head.nbytes:
                        views[0] = head[n:]
                        break
                    n -= head.nbytes
                    views.pop(0)
        except (ConnectionError, OSError) as exc:
            raise self._lost(str(exc)) from exc
        except asyncio.CancelledError:
            self._shutdown()  # a half-moved frame cannot be resumed
            raise

    async def send(self, header: bytes, segments: Sequence[Buffer] = ()) -> None:
        views = [as_bytes_view(s) for s in segments]
        preamble = encode_preamble(header, [v.nbytes for v in views])
        await self._io([memoryview(preamble), *views], writing=True)

    async def _recv_exact(self, view: memoryview) -> None:
        await self._io([view], writing=False)

    async def recv(self) -> Frame:
        if self._closed:
            raise PeerLostError(f"connection to {self.peer} is closed")
        pre = bytearray(PREAMBLE.size)
        await self._recv_exact(memoryview(pre))
        try:
            header_len, nseg = decode_preamble(pre)
        except ProtocolError:
            self._shutdown()
            raise
        rest = bytearray(header_len + 8 * nseg)
        await self._recv_exact(memoryview(rest))
        return Frame(bytes(rest[:header_len]), decode_sizes(rest[header_len:]))

    async def recv_segments(self, frame: Frame, into: Sequence[Buffer]) -> None:
        await self._io(check_into(frame, into), writing=False)

    def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    async def close(self) -> None:
        self._shutdown()


class TcpListener(Listener):
    def __init__(self, sock: socket.socket, handler: Handler):
        self._sock = sock
        self._handler = handler
        self.port = sock.getsockname()[1]
        self._conns: set[asyncio.Task[None]] = set()
        self._accept_task = asyncio.create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(self._sock)
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            task = asyncio.create_task(self._serve(TcpConnection(sock, f"{addr[0]}:{addr[1]}")))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: TcpConnection) -> None:
        try:
            await self._handler(conn)
        finally:
            await conn.close()

    async def close(self) -> None:
        self._accept_task.cancel()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(self._accept_task, *self._conns, return_exceptions=True)
        self._sock.close()


class TcpTransport(Transport):
    name = "tcp"

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        # SO_REUSEADDR: a restart binds while the old connections sit in TIME_WAIT;
        # a port another process listens on is PortInUseError
        sock = listen_socket(host, port, "data plane", backlog=256)
        sock.setblocking(False)
        return TcpListener(sock, handler)

    async def connect(self, host: str, port: int, *, timeout: float = 5.0) -> Connection:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(timeout):
                await loop.sock_connect(sock, (host, port))
        except TimeoutError as exc:
            sock.close()
            raise TransportTimeoutError(f"connect to {host}:{port} timed out") from exc
        except OSError as exc:
            sock.close()
            raise PeerLostError(f"cannot connect to {host}:{port}: {exc}") from exc
        return TcpConnection(sock, f"{host}:{port}")
