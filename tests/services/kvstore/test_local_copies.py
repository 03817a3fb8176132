"""Same-host clients over a real TCP data plane, with the store in this process so its
slots can be watched: a slot handed to a local client for copying is never freed or
reused until that client's ack (or its connection's end), whatever revokes, expires
or evicts the block meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from itertools import count

import numpy as np
import pytest
import pytest_asyncio

from services.kvstore.dataplane import DataPlane
from services.kvstore.metrics import StoreMetrics
from services.kvstore.store import BlockStore, StoreConfig
from shared.cluster.auth import ClusterSecret
from shared.cluster.membership import Member
from shared.kvstore.node_client import NodeClient
from shared.kvstore.protocol import (
    Ack,
    BlockSpec,
    Commit,
    Get,
    Hello,
    HelloAuth,
    LayerRange,
    Ping,
    Reserve,
    Response,
    Revoke,
    Write,
    decode_response,
    encode,
)
from shared.transport import Listener, Transport, make_transport
from shared.transport.base import Connection

KB = 1 << 10
BLOCK = 64 * KB  # 4 per slab, 16 in the store
SLAB = 256 * KB
CAPACITY = 1024 * KB
LAYERS = 2
_ids = count(1)


def bid() -> str:
    return f"{time.monotonic_ns():016x}{next(_ids):016x}"


class NoIndex:
    def added(self, ids: Sequence[str]) -> None:
        return None

    def removed(self, ids: Sequence[str]) -> None:
        return None


@dataclass
class Node:
    """A store and its data plane listening on a real TCP port, in this process."""

    store: BlockStore
    transport: Transport
    listener: Listener
    secret: ClusterSecret

    def client(self, client_id: str = "client", *, shm: bool = True) -> NodeClient:
        member = Member(
            instance_id="local",
            role="kvstore",
            host="127.0.0.1",
            http_port=0,
            data_port=self.listener.port,
        )
        return NodeClient(self.transport, member, client_id, secret=self.secret, shm=shm)

    async def raw(self, client_id: str = "raw") -> Raw:
        conn = await self.transport.connect("127.0.0.1", self.listener.port)
        raw = Raw(conn)
        proof = self.secret.prove(client_id)
        auth = None if proof is None else HelloAuth(nonce=proof.nonce, ts=proof.ts, mac=proof.mac)
        raw.hello = await raw.ask(Hello(client_id=client_id, auth=auth, shm=True))
        return raw

    @property
    def used(self) -> int:
        return self.store.arena.used_bytes


class Raw:
    """One data connection spoken by hand, to hold a copy window open on purpose."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.hello = Response()

    async def send(self, req: Ack | Commit | Get | Ping | Reserve | Revoke | Write) -> None:
        await self.conn.send(encode(req))

    async def recv(self) -> Response:
        return decode_response((await self.conn.recv()).header)

    async def ask(
        self, req: Hello | Ack | Commit | Get | Ping | Reserve | Revoke | Write
    ) -> Response:
        await self.conn.send(encode(req))
        return await self.recv()

    async def reserve(self, *ids: str, ttl_s: float = 30.0) -> Response:
        specs = [BlockSpec(id=i, size=BLOCK) for i in ids]
        return await self.ask(Reserve(blocks=specs, num_layers=LAYERS, ttl_s=ttl_s))

    async def begin_write(self, block_id: str, layer: int | None = None) -> int:
        """A local write's offset: from here until the ack the block is ours to copy to."""
        span = None if layer is None else LayerRange(start=layer, stop=layer + 1)
        size = BLOCK if layer is None else BLOCK // LAYERS
        resp = await self.ask(Write(ids=[block_id], layers=span, local=True, sizes=[size]))
        assert resp.ok and resp.offsets is not None, resp
        (offset,) = resp.offsets
        assert offset is not None
        return offset

    async def close(self) -> None:
        await self.conn.close()


def sample(node: Node, counter: str) -> float:
    value = node.store.metrics.registry.get_sample_value(f"baton_kvstore_{counter}_total")
    return 0.0 if value is None else value


async def acked(raw: Raw, ok: bool = True) -> None:
    """Send the ack, and know the store has read it (a later reply on the same connection)."""
    await raw.send(Ack(ok=ok))
    assert (await raw.ask(Ping())).ok


def code(resp: Response) -> str | None:
    return None if resp.error is None else resp.error.code


async def fill(node: Node, raw: Raw) -> list[int]:
    """Reserve blocks until the store refuses: the offsets every other slot got."""
    offsets: list[int] = []
    while True:
        block_id = bid()
        resp = await raw.reserve(block_id)
        if not resp.ok:
            assert code(resp) == "no_space", resp
            return offsets
        offsets.append(await raw.begin_write(block_id))
        await acked(raw, ok=False)  # nothing copied; the slot stays reserved


async def wait_until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def start(shared: bool = True, secret: str | None = None) -> Node:
    config = StoreConfig(CAPACITY, SLAB, shared=shared)
    store = BlockStore(config, StoreMetrics(), NoIndex())
    cluster_secret = ClusterSecret(secret)
    plane = DataPlane(store, store.metrics, secret=cluster_secret)
    transport = make_transport("tcp")
    listener = await transport.listen("127.0.0.1", 0, plane.serve)
    return Node(store, transport, listener, cluster_secret)


@pytest_asyncio.fixture
async def node() -> AsyncIterator[Node]:
    made = await start()
    yield made
    await made.listener.close()
    made.store.close()


async def test_a_local_client_copies_through_the_arena(node: Node) -> None:
    client = node.client()
    ids = [bid() for _ in range(3)]
    data = [np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8) for i in range(3)]
    specs = [BlockSpec(id=i, size=BLOCK) for i in ids]
    assert await client.put(specs, data, LAYERS) == ["reserved"] * 3
    assert client.local
    out = [np.zeros(BLOCK, np.uint8) for _ in ids]
    await client.get(ids, out)
    assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
    half = [np.zeros(BLOCK // LAYERS, np.uint8) for _ in ids]
    await client.get(ids, half, layers=(1, 2))
    assert all(np.array_equal(a[BLOCK // LAYERS :], b) for a, b in zip(data, half, strict=True))
    await client.ping()  # on the same pooled connection: after the last (unanswered) ack
    assert sample(node, "local_bytes_in") == 3 * BLOCK
    assert sample(node, "local_bytes_out") == 3 * BLOCK + 3 * BLOCK // LAYERS
    await client.close()


async def test_a_commit_waits_for_a_local_write_still_being_acked(node: Node) -> None:
    """A local write's ack is not answered; its commit may come first on another
    connection and must find the layers written, not refuse the block."""
    writer, committer = await node.raw("w"), await node.raw("w")
    block_id = bid()
    await writer.reserve(block_id)
    await writer.begin_write(block_id)
    await committer.send(Commit(ids=[block_id]))
    await asyncio.sleep(0.1)
    await writer.send(Ack())  # copied: mark the block written
    assert (await committer.recv()).ok
    assert node.store.lookup([block_id]) == 1
    await writer.close()
    await committer.close()


async def test_a_revoke_during_a_local_write_frees_the_slot_only_after_the_ack(
    node: Node,
) -> None:
    writer, other = await node.raw("writer"), await node.raw("other")
    block_id = bid()
    await writer.reserve(block_id)
    mine = await writer.begin_write(block_id, layer=0)
    assert (await other.ask(Revoke(ids=[block_id]))).ok
    assert node.store.lookup([block_id]) == 0 and node.used == BLOCK  # gone, slot held
    others = await fill(node, other)
    assert len(others) == CAPACITY // BLOCK - 1
    assert all(abs(o - mine) >= BLOCK for o in others)  # never handed out twice
    await acked(writer)  # the copy is done: now the slot may go
    assert node.used == len(others) * BLOCK
    again = bid()
    assert (await other.reserve(again)).ok
    assert await other.begin_write(again) == mine  # and it is reused only now
    assert code(await writer.ask(Commit(ids=[block_id]))) == "miss"
    await writer.close()
    await other.close()


async def test_an_expired_reservation_keeps_its_slot_while_a_local_write_runs(
    node: Node,
) -> None:
    writer, other = await node.raw("writer"), await node.raw("other")
    block_id = bid()
    await writer.reserve(block_id, ttl_s=0.05)
    mine = await writer.begin_write(block_id)
    await asyncio.sleep(0.1)
    node.store.expire()  # the sweeper's job
    assert node.store.lookup([block_id]) == 0 and node.used == BLOCK
    others = await fill(node, other)
    assert all(abs(o - mine) >= BLOCK for o in others)
    await acked(writer)
    assert node.used == len(others) * BLOCK
    await writer.close()
    await other.close()


async def test_a_local_writer_vanishing_mid_copy_frees_its_slot(node: Node) -> None:
    writer = await node.raw("vanishing")
    block_id = bid()
    await writer.reserve(block_id)
    await writer.begin_write(block_id, layer=1)
    assert node.used == BLOCK
    await writer.close()  # its only connection: the pin and the reservation go
    await wait_until(lambda: node.used == 0)


async def test_a_local_read_pins_its_block_against_eviction_until_the_ack(node: Node) -> None:
    client = node.client()
    held = bid()
    data = np.full(BLOCK, 5, np.uint8)
    await client.put([BlockSpec(id=held, size=BLOCK)], [data], LAYERS)
    reader, other = await node.raw("reader"), await node.raw("other")
    resp = await reader.ask(Get(ids=[held], local=True))
    assert resp.offsets is not None and resp.sizes == [BLOCK]
    (offset,) = resp.offsets
    assert offset is not None
    others = await fill(node, other)  # would evict the committed block if it could
    assert all(abs(o - offset) >= BLOCK for o in others)
    assert (node.store.arena.buffer[offset : offset + BLOCK] == 5).all()
    await acked(reader)
    evictor = bid()
    assert (await other.reserve(evictor)).ok  # the ack made it evictable
    assert await other.begin_write(evictor) == offset
    assert node.store.lookup([held]) == 0
    await reader.close()
    await other.close()
    await client.close()


async def test_a_stream_ending_in_an_error_keeps_its_pin_until_the_ack(node: Node) -> None:
    writer = node.client("writer")
    block_id = bid()
    await writer.reserve([BlockSpec(id=block_id, size=BLOCK)], LAYERS)
    await writer.write([block_id], [np.ones(BLOCK // LAYERS, np.uint8)], (0, 1))
    reader = await node.raw("reader")
    await reader.send(Get(ids=[block_id], stream=True, wait_s=10, local=True))
    chunk = await reader.recv()
    assert chunk.kind == "chunk" and chunk.offsets is not None
    await writer.revoke([block_id])
    end = await reader.recv()
    assert code(end) == "miss"  # revoked while being read
    assert node.used == BLOCK  # but the reader may still be copying layer 0
    await acked(reader)
    assert node.used == 0
    await reader.close()
    await writer.close()


async def test_a_local_reader_vanishing_releases_its_pin(node: Node) -> None:
    client = node.client()
    held = bid()
    await client.put([BlockSpec(id=held, size=BLOCK)], [np.ones(BLOCK, np.uint8)], LAYERS)
    reader = await node.raw("reader")
    assert (await reader.ask(Get(ids=[held], local=True))).offsets is not None
    await reader.close()
    other = await node.raw("other")
    await fill(node, other)
    assert node.store.lookup([held]) == 0  # evicted: nothing pinned it any more
    await other.close()
    await client.close()


async def test_anything_but_the_ack_is_refused_and_ends_the_copy(node: Node) -> None:
    raw = await node.raw("confused")
    block_id = bid()
    await raw.reserve(block_id)
    await raw.begin_write(block_id)
    assert code(await raw.ask(Ping())) == "bad_request"  # not the ack: the write is void
    assert code(await raw.ask(Commit(ids=[block_id]))) == "bad_request"  # not written
    assert code(await raw.ask(Ack())) == "bad_request"  # nothing to acknowledge
    wrong = await raw.ask(Write(ids=[block_id], local=True, sizes=[BLOCK - 1]))
    assert code(wrong) == "bad_request" and wrong.offsets is None
    assert (await raw.ask(Revoke(ids=[block_id]))).ok
    assert node.used == 0
    await raw.close()


async def test_a_node_without_a_shared_arena_serves_local_clients_by_socket() -> None:
    plain = await start(shared=False)
    try:
        raw = await plain.raw()
        assert raw.hello.arena is None
        block_id = bid()
        await raw.reserve(block_id)
        assert code(await raw.ask(Write(ids=[block_id], local=True, sizes=[BLOCK]))) == (
            "bad_request"
        )
        await raw.close()
        client = plain.client()
        data = np.full(BLOCK, 3, np.uint8)
        await client.put([BlockSpec(id=bid(), size=BLOCK)], [data], LAYERS)
        assert not client.local
        await client.close()
    finally:
        await plain.listener.close()
        plain.store.close()


async def test_the_arena_is_named_only_to_a_client_that_proved_the_secret() -> None:
    guarded = await start(secret="s" * 32)
    try:
        good = await guarded.raw("good")
        assert good.hello.arena is not None
        assert good.hello.arena.path == str(guarded.store.arena.shm_path)
        await good.close()
        conn = await guarded.transport.connect("127.0.0.1", guarded.listener.port)
        await conn.send(encode(Hello(client_id="intruder", shm=True)))
        reply = decode_response((await conn.recv()).header)
        assert not reply.ok and reply.arena is None
        await conn.close()
    finally:
        await guarded.listener.close()
        guarded.store.close()


async def test_a_client_that_cannot_map_the_arena_uses_the_socket(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.kvstore import local_arena

    monkeypatch.setattr(local_arena.LocalArena, "open", classmethod(_refuse))
    client = node.client()
    data = np.full(BLOCK, 8, np.uint8)
    block_id = bid()
    await client.put([BlockSpec(id=block_id, size=BLOCK)], [data], LAYERS)
    out = np.zeros(BLOCK, np.uint8)
    await client.get([block_id], [out])
    assert not client.local and (out == 8).all()
    assert sample(node, "local_bytes_in") == 0 and sample(node, "bytes_in") == BLOCK
    await client.close()


def _refuse(cls: type, path: str, size: int) -> None:
    raise PermissionError(13, "not yours", path)
