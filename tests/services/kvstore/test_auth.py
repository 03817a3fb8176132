"""The data plane demands the cluster secret: a block write (cache poisoning) or read
without it is refused and counted; a recorded hello cannot be replayed."""

from __future__ import annotations

import re
import time

import httpx
import numpy as np
import pytest

from shared.cluster.auth import ClusterSecret
from shared.errors import KVUnauthorizedError
from shared.kvstore.protocol import (
    BlockSpec,
    Hello,
    HelloAuth,
    Put,
    decode_response,
    encode,
)
from shared.transport import Transport
from tests.services.kvstore.conftest import TRANSPORTS, ClientFactory, StoreFactory, prefix

pytestmark = pytest.mark.asyncio(loop_scope="session")

SECRET = "test-cluster-secret-0123456789abcdef"
SIZE = 4096


def refused(store_http: str) -> float:
    text = httpx.get(f"{store_http}/metrics", timeout=10).text
    found = re.search(
        r'^baton_internal_auth_refused_total\{surface="dataplane"\} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_writes_and_reads_need_the_secret(
    start_store: StoreFactory,
    make_client: ClientFactory,
    transports: dict[str, Transport],
    transport: str,
) -> None:
    p = prefix()
    store = start_store(transport, p, secret=SECRET)
    good = make_client(transport, p, secret=SECRET)
    block_id = f"{time.monotonic_ns():032x}"
    data = np.full(SIZE, 7, dtype=np.uint8)
    (node,) = await good.nodes(force=True)
    await node.put([BlockSpec(id=block_id, size=SIZE)], [data], 1)
    await node.commit([block_id])
    assert await node.lookup([block_id]) == 1

    for secret in (None, "a-wrong-secret-of-enough-length"):
        (bad,) = await make_client(transport, p, secret=secret).nodes(force=True)
        with pytest.raises(KVUnauthorizedError):
            await bad.put([BlockSpec(id=block_id, size=SIZE)], [np.zeros(SIZE, np.uint8)], 1)
        with pytest.raises(KVUnauthorizedError):
            await bad.get([block_id], [np.zeros(SIZE, np.uint8)])

    # a put sent straight away, with no hello at all: refused and the connection closed
    member = node.member
    conn = await transports[transport].connect(member.host, int(member.data_port or 0))
    poison = BlockSpec(id=f"{time.monotonic_ns() + 1:032x}", size=SIZE)
    await conn.send(encode(Put(blocks=[poison], num_layers=1)), [np.ones(SIZE, np.uint8)])
    reply = decode_response((await conn.recv()).header)
    assert not reply.ok and reply.error is not None and reply.error.code == "unauthorized"
    await conn.close()
    assert await node.lookup([poison.id]) == 0

    # a valid hello recorded and sent again on a new connection: refused (replay)
    proof = ClusterSecret(SECRET).prove("eavesdropped")
    assert proof is not None
    hello = encode(
        Hello(
            client_id="eavesdropped",
            auth=HelloAuth(nonce=proof.nonce, ts=proof.ts, mac=proof.mac),
        )
    )
    answers = []
    for _ in range(2):
        conn = await transports[transport].connect(member.host, int(member.data_port or 0))
        await conn.send(hello)
        answers.append(decode_response((await conn.recv()).header).ok)
        await conn.close()
    assert answers == [True, False]

    # the owner's data is intact and every refusal was counted
    out = np.zeros(SIZE, np.uint8)
    await node.get([block_id], [out])
    assert (out == 7).all()
    assert refused(store.http) >= 6
