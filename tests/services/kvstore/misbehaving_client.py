"""A client that dies on purpose (run as a subprocess by the tests).

``python -m tests.services.kvstore.misbehaving_client MODE HOST PORT TRANSPORT``

- ``mid-put``: reserves 4 blocks, writes half of their layers, then SIGKILLs itself.
- ``mid-transfer``: reserves one 4 MiB block, announces its whole payload but
  sends only part of it (TCP), then SIGKILLs itself.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

import numpy as np

from shared.cluster.membership import Member
from shared.kvstore.node_client import NodeClient
from shared.kvstore.protocol import BlockSpec, Write, encode
from shared.transport import make_transport
from shared.transport.base import encode_preamble

LAYERS = 8
BLOCK = 8 * 4096


def ids(tag: str, n: int) -> list[str]:
    return [f"{tag}{i:08x}".ljust(32, "0") for i in range(n)]


async def mid_put(host: str, port: int, transport: str) -> None:
    node = NodeClient(
        make_transport(transport),
        Member(instance_id="x", role="kvstore", host=host, http_port=0, data_port=port),
        client_id="doomed-writer",
    )
    block_ids = ids("dead", 4)
    await node.reserve([BlockSpec(id=i, size=BLOCK) for i in block_ids], LAYERS, ttl_s=600)
    data = np.full(BLOCK // LAYERS, 7, dtype=np.uint8)
    for layer in range(LAYERS // 2):
        await node.write(block_ids, [data] * len(block_ids), (layer, layer + 1))
    print("half-written", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


async def mid_transfer(host: str, port: int) -> None:
    node = NodeClient(
        make_transport("tcp"),
        Member(instance_id="x", role="kvstore", host=host, http_port=0, data_port=port),
        client_id="vanishing",
    )
    (block_id,) = ids("beef", 1)
    await node.reserve([BlockSpec(id=block_id, size=4 << 20)], 1, ttl_s=600)
    sock = socket.create_connection((host, port))
    header = encode(Write(ids=[block_id]))
    sock.sendall(encode_preamble(header, [4 << 20]))
    sock.sendall(bytes(1 << 20))
    print("partial", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    mode, host, port, transport = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if mode == "mid-put":
        asyncio.run(mid_put(host, port, transport))
    else:
        asyncio.run(mid_transfer(host, port))


if __name__ == "__main__":
    main()
