"""Listening sockets: connections accepted on them send small writes at once."""

from __future__ import annotations

import asyncio
import socket

from shared.ports import listen_socket


def test_connections_accepted_by_asyncio_have_nodelay() -> None:
    """uvicorn serves on the socket we bind; asyncio turns Nagle off on what it accepts
    only for sockets that say IPPROTO_TCP. With Nagle on, a streamed response's first
    event after its headers waited for the client's delayed ACK (40 ms of TTFT)."""
    seen: list[int] = []

    async def main() -> None:
        sock = listen_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted = writer.get_extra_info("socket")
            seen.append(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_client, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(main())
    assert seen and seen[0] != 0
