"""A real KV store process over a real redis-server, driven through both transports."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis

from shared.cluster.keys import Keys
from shared.cluster.membership import live_members
from shared.errors import KVBadRequestError, KVMissError, TransportError
from shared.kvstore.client import KVStoreClient
from shared.kvstore.node_client import NodeClient
from shared.kvstore.placement import rank
from shared.kvstore.protocol import BlockSpec
from shared.procs import RedisProcess
from shared.transport import Transport
from tests.services.kvstore.conftest import (
    TRANSPORTS,
    ClientFactory,
    OneStore,
    StoreFactory,
    StoreNode,
    prefix,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")
RNG = np.random.default_rng(0)


def blocks(n: int, size: int) -> list[np.ndarray]:
    return [RNG.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def ids(n: int, tag: int = 0) -> list[str]:
    base = time.monotonic_ns()
    return [f"{base:016x}{tag:04x}{i:012x}" for i in range(n)]


def start_stream(
    client: KVStoreClient, keys: list[str], out: list[np.ndarray], layers: int, wait_s: float
) -> tuple[asyncio.Task[None], list[int]]:
    """A background layer-stream reader and the layer indices it has seen so far."""
    seen: list[int] = []

    async def read() -> None:
        async for layer in client.stream(keys, out, num_layers=layers, wait_s=wait_s):
            seen.append(layer)

    return asyncio.create_task(read()), seen


def bytes_out(store: StoreNode) -> float:
    text = httpx.get(f"{store.http}/metrics").text
    return float(re.search(r"^baton_kvstore_bytes_out_total (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def misbehave(mode: str, port: int, transport: str) -> subprocess.CompletedProcess[str]:
    module = "tests.services.kvstore.misbehaving_client"
    args = [sys.executable, "-m", module, mode, "127.0.0.1", str(port), transport]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


async def only_node(client: KVStoreClient) -> NodeClient:
    (node,) = await client.nodes(force=True)
    return node


async def wait_until(check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result if isinstance(result, bool) else await result:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


def connections(store: StoreNode) -> float:
    text = httpx.get(f"{store.http}/metrics").text
    return float(re.search(r"^baton_kvstore_connections (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_connect_opens_the_links_a_first_request_then_reuses(
    transport: str, one_store: OneStore
) -> None:
    """A service connects at start-up, so that its first request does not pay for the
    connections (and the imports, the endpoint, the arena's mapping behind them)."""
    store, client = one_store(transport)
    assert connections(store) == 0
    assert await client.connect(links=2) == 1
    await wait_until(lambda: connections(store) == 2)
    keys = ids(2)
    await client.put(keys, blocks(2, 4096), num_layers=1)  # on the links already open
    assert await client.lookup(keys) == 2
    assert connections(store) == 2
    store.proc.kill()  # a node registered but gone: reported, not raised
    started = time.monotonic()
    assert await client.connect(links=2, timeout_s=2.0) == 0
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_connect_counts_the_nodes_that_answered_when_one_hangs(
    transport: str, start_store: StoreFactory, make_client: ClientFactory
) -> None:
    """A node that stops answering on links it had opened (stopped, not dead) costs the
    timeout, not the count of the nodes that did answer."""
    p = prefix()
    live, hung = start_store(transport, p), start_store(transport, p)
    client = make_client(transport, p)
    assert await client.connect(links=2) == 2
    hung_proc = hung.proc.proc
    assert hung_proc is not None
    hung_proc.send_signal(signal.SIGSTOP)  # its heartbeat lives for another ~1 s
    try:
        started = time.monotonic()
        assert await client.connect(links=2, timeout_s=0.5) == 1
        assert time.monotonic() - started < 2.0
    finally:
        hung_proc.send_signal(signal.SIGCONT)
    await wait_until(lambda: connections(live) == 2)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_round_trips_are_byte_exact(transport: str, one_store: OneStore) -> None:
    _, client = one_store(transport)
    for size, layers in [(1024, 1), (23_040 * 16, 30), (46_080 * 16, 30), (3 << 20, 8)]:
        data, keys = blocks(5, size), ids(5, size % 9973)
        await client.put(keys, data, num_layers=layers)
        out = [np.zeros(size, np.uint8) for _ in keys]
        await client.get(keys, out)
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
        assert await client.lookup(keys) == 5
        if layers > 1:  # a layer range of each block
            lb = size // layers
            part = [np.zeros(2 * lb, np.uint8) for _ in keys]
            await client.get(keys, part, layers=(layers - 2, layers))
            assert all(np.array_equal(a[-2 * lb :], b) for a, b in zip(data, part, strict=True))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_layerwise_write_streams_to_a_waiting_reader(
    transport: str, start_store: StoreFactory, make_client: ClientFactory
) -> None:
    p = prefix()
    start_store(transport, p)
    writer, reader = make_client(transport, p), make_client(transport, p)
    layers, size = 30, 46_080 * 16
    data, keys = blocks(6, size), ids(6)
    handle = await writer.begin_put(keys, [size] * 6, num_layers=layers)
    out = [np.zeros(size, np.uint8) for _ in keys]
    task, seen = start_stream(reader, keys, out, layers, wait_s=20)
    lb = size // layers
    for layer in range(layers):
        await handle.write(
            keys, [d[layer * lb : (layer + 1) * lb] for d in data], (layer, layer + 1)
        )
        if layer == 3:
            await wait_until(lambda: len(seen) >= 4)  # the reader has layers before the commit
    await handle.commit()
    await asyncio.wait_for(task, 20)
    assert seen == list(range(layers))
    assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))


@pytest.mark.parametrize(("transport", "shm"), [("tcp", True), ("tcp", False), ("ucx", False)])
async def test_a_stream_reads_only_the_layers_each_block_names(
    transport: str, shm: bool, start_store: StoreFactory, make_client: ClientFactory
) -> None:
    """``only``: per block, the only layers to read (a sliding window's reader needs some
    layers of a block and not others). Those land, nothing else is written, the store
    sends no more, and each layer is yielded once every block that reads it has it,
    while the writer still writes layer by layer."""
    p = prefix()
    store = start_store(transport, p)
    writer, reader = make_client(transport, p), make_client(transport, p, shm=shm)
    layers, size = 6, 6 * 4096
    lb = size // layers
    data, keys = blocks(4, size), ids(4)
    only = [None, (1, 4), None, (0,)]
    handle = await writer.begin_put(keys, [size] * 4, num_layers=layers)
    out = [np.full(size, 7, np.uint8) for _ in keys]
    seen: list[int] = []

    async def read() -> None:
        async for layer in reader.stream(
            keys, [], num_layers=layers, wait_s=20,
            layer_into=lambda i, layer: out[i][layer * lb : (layer + 1) * lb], only=only,
        ):  # fmt: skip
            seen.append(layer)

    before = bytes_out(store)
    task = asyncio.create_task(read())
    for layer in range(layers):
        await handle.write(
            keys, [d[layer * lb : (layer + 1) * lb] for d in data], (layer, layer + 1)
        )
    await handle.commit()
    await asyncio.wait_for(task, 20)
    assert seen == list(range(layers))
    for block, got, wanted in zip(data, out, only, strict=True):
        for layer in range(layers):
            piece = got[layer * lb : (layer + 1) * lb]
            if wanted is None or layer in wanted:
                assert np.array_equal(piece, block[layer * lb : (layer + 1) * lb])
            else:
                assert (piece == 7).all(), layer
    assert bytes_out(store) - before == lb * (2 * layers + 2 + 1)
    node = await only_node(reader)
    with pytest.raises(KVBadRequestError, match="layer"):
        async for _ in node.stream(keys, lambda layer: [], layer_ids=[2, 9], wait_s=1):
            pass


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_concurrent_writers_and_readers(
    transport: str, start_store: StoreFactory, make_client: ClientFactory
) -> None:
    p = prefix()
    start_store(transport, p)
    clients = [make_client(transport, p) for _ in range(3)]
    size = 23_040 * 16
    jobs = [(ids(4, tag), blocks(4, size)) for tag in range(12)]

    async def put_then_get(i: int, keys: list[str], data: list[np.ndarray]) -> bool:
        client = clients[i % len(clients)]
        await client.put(keys, data, num_layers=30)
        out = [np.zeros(size, np.uint8) for _ in keys]
        await clients[(i + 1) % len(clients)].get(keys, out)
        return all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))

    assert all(await asyncio.gather(*(put_then_get(i, k, d) for i, (k, d) in enumerate(jobs))))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_writer_killed_mid_put_leaves_nothing_visible(
    transport: str,
    start_store: StoreFactory,
    make_client: ClientFactory,
    redis_server: RedisProcess,
) -> None:
    p = prefix()
    start_store(transport, p)
    client = make_client(transport, p)
    node = await only_node(client)
    port = str(node.member.data_port)
    mode = "mid-put"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.services.kvstore.misbehaving_client",
            mode,
            "127.0.0.1",
            port,
            transport,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "half-written" in proc.stdout, proc.stderr
    dead = [f"dead{i:08x}".ljust(32, "0") for i in range(4)]

    async def freed() -> bool:
        return (await node.ping())["blocks_reserved"] == 0

    await wait_until(freed)  # the writer's last connection closed: reservation freed
    assert await client.lookup(dead) == 0
    with pytest.raises(KVMissError):
        await node.get(dead, [np.zeros(8 * 4096, np.uint8)] * 4, wait_s=0.2)
    assert (await node.ping())["bytes_used"] == 0


async def test_client_vanishing_mid_transfer_frees_its_reservation(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    p = prefix()
    start_store("tcp", p)
    node = await only_node(make_client("tcp", p))
    proc = misbehave("mid-transfer", int(node.member.data_port or 0), "tcp")
    assert "partial" in proc.stdout, proc.stderr

    async def freed() -> bool:
        stats = await node.ping()
        return stats["blocks_reserved"] == 0 and stats["bytes_used"] == 0

    await wait_until(freed)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_bad_input_gets_clear_errors_and_leaks_nothing(
    transport: str,
    start_store: StoreFactory,
    make_client: ClientFactory,
    transports: dict[str, Transport],
) -> None:
    p = prefix()
    start_store(transport, p)
    node = await only_node(make_client(transport, p))
    keys = ids(2)
    await node.reserve([BlockSpec(id=k, size=4096) for k in keys], num_layers=4)
    with pytest.raises(KVBadRequestError, match="do not match"):
        await node.write(keys, [np.zeros(4096, np.uint8), np.zeros(4000, np.uint8)])
    with pytest.raises(KVBadRequestError, match="outside"):
        await node.write(keys, [np.zeros(1024, np.uint8)] * 2, layers=(3, 5))
    await node.revoke(keys)
    with pytest.raises(KVMissError):
        await node.get(ids(3, 7), [np.zeros(4096, np.uint8)] * 3, wait_s=5)  # unknown: no waiting
    with pytest.raises(KVBadRequestError, match="largest block"):
        await node.reserve([BlockSpec(id=ids(1, 9)[0], size=64 << 20)], num_layers=1)
    with pytest.raises(KVBadRequestError, match="not reserved"):
        await node.write(ids(1, 5), [np.zeros(16, np.uint8)])
    # A frame whose header is not a valid request: answered, connection still usable.
    conn = await transports[transport].connect("127.0.0.1", int(node.member.data_port or 0))
    await conn.send(b'{"op": "explode", "ids": 5}', [np.zeros(100, np.uint8)])
    frame = await conn.recv()
    assert b'"bad_request"' in frame.header
    await conn.send(b"not json at all")
    assert b'"bad_request"' in (await conn.recv()).header
    await conn.close()
    # Raw garbage on the data port: the server drops that connection and stays up.
    with socket.create_connection(("127.0.0.1", int(node.member.data_port or 0))) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)) * 64)
        await asyncio.sleep(0.2)  # let the node read the garbage before we ping
    stats = await node.ping()
    assert stats["blocks_reserved"] == 0 and stats["bytes_used"] == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_capacity_pressure_spares_leases_and_keeps_the_index_exact(
    transport: str,
    one_store: OneStore,
    redis_server: RedisProcess,
) -> None:
    store, client = one_store(transport, capacity_gb="0.03125", slab_mb="4")  # 32 MiB
    p = client.keys.prefix
    size = 46_080 * 16  # 720 KiB: 5 per 4 MiB slab, 40 in the store
    pinned_keys, pinned_data = ids(4, 1), blocks(4, size)
    await client.put(pinned_keys, pinned_data, num_layers=30)
    lease = await client.lease(pinned_keys, ttl_s=120)
    for round_ in range(12):  # 96 more blocks through a 40-block store
        await client.put(ids(8, 100 + round_), blocks(8, size), num_layers=30)
    out = [np.zeros(size, np.uint8) for _ in pinned_keys]
    await client.get(pinned_keys, out)
    assert all(np.array_equal(a, b) for a, b in zip(pinned_data, out, strict=True))
    await lease.release()
    metrics = httpx.get(f"{store.http}/metrics").text
    assert "baton_kvstore_evictions_total" in metrics
    evicted = [
        line for line in metrics.splitlines() if line.startswith("baton_kvstore_evictions_total")
    ]
    assert float(evicted[0].split()[-1]) >= 56

    redis = aioredis.from_url(redis_server.url)
    node = await only_node(client)

    async def consistent() -> bool:
        indexed = set()
        async for key in redis.scan_iter(match=f"{p}:block:*", count=1000):
            if await redis.sismember(key, store.instance_id):
                indexed.add(key.decode().rsplit(":", 1)[1])
        held = {k for k in indexed if await node.lookup([k]) == 1}
        stats = await node.ping()
        return held == indexed and len(indexed) == stats["blocks_held"]

    await wait_until(consistent)
    await redis.aclose()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_replicated_blocks_survive_a_store_node_kill(
    transport: str, start_store: StoreFactory, make_client: ClientFactory
) -> None:
    p = prefix()
    nodes = [start_store(transport, p) for _ in range(3)]
    client = make_client(transport, p, replication=2, timeout_s=5.0)
    size = 23_040 * 16
    keys, data = ids(24), blocks(24, size)
    await client.put(keys, data, num_layers=30)
    held = {n.instance_id: (await n.ping())["blocks_held"] for n in await client.nodes(force=True)}
    assert sum(held.values()) == 2 * len(keys)
    victim = max(nodes, key=lambda n: held[n.instance_id])
    victim.proc.kill()
    # the dead node is still registered (TTL): leases, reads and new puts go around it
    fresh = make_client(transport, p, replication=2, timeout_s=5.0)
    lease = await fresh.lease(keys)
    out = [np.zeros(size, np.uint8) for _ in keys]
    await fresh.get(keys, out)
    assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
    await lease.release()
    more, more_data = ids(8), blocks(8, size)
    await make_client(transport, p, replication=2, timeout_s=5.0).put(more, more_data)
    two_phase, two_phase_data = ids(4), blocks(4, size)
    handle = await make_client(transport, p, replication=2, timeout_s=5.0).begin_put(
        two_phase, [size] * 4, num_layers=1
    )
    await handle.write(two_phase, two_phase_data)
    await handle.commit()
    live = [n for n in await fresh.nodes(force=True) if n.instance_id != victim.instance_id]
    after = sum([(await n.ping())["blocks_held"] for n in live])
    before = sum(held[n.instance_id] for n in live)
    assert after - before == 2 * (len(more) + len(two_phase))  # two live replicas each


async def test_http_control_plane_and_clean_shutdown(
    one_store: OneStore, redis_server: RedisProcess
) -> None:
    store, client = one_store("tcp")
    p = client.keys.prefix
    keys = ids(3)
    await client.put(keys, blocks(3, 4096), num_layers=1)
    assert httpx.get(f"{store.http}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{store.http}/ready").json()
    assert ready["status"] == "ready" and ready["redis"] is True
    assert httpx.get(f"{store.http}/stats").json()["blocks_held"] == 3
    metrics = httpx.get(f"{store.http}/metrics").text
    for name in (
        "bytes_in_total",
        "bytes_out_total",
        "blocks_held",
        "hits_total",
        "op_seconds_bucket",
    ):
        assert f"baton_kvstore_{name}" in metrics
    redis = aioredis.from_url(redis_server.url)
    keyspace = Keys(p)

    async def indexed() -> bool:
        return await client.lookup(keys) == 3

    await wait_until(indexed)
    assert store.proc.stop() is not None  # SIGTERM: clean shutdown
    assert await live_members(redis, keyspace, "kvstore") == []
    assert await redis.exists(*(keyspace.block(k) for k in keys)) == 0
    await redis.aclose()


async def test_redis_outage_is_degraded_not_fatal(
    start_store: StoreFactory, transports: dict[str, Transport]
) -> None:
    """Kill Redis under a running store: data plane keeps serving; on return it re-registers."""
    own = RedisProcess().start()
    try:
        p = prefix()
        store = start_store("tcp", p, redis_url=own.url)
        redis = aioredis.from_url(own.url)
        client = KVStoreClient(transports["tcp"], redis, Keys(p), refresh_s=0.1)
        node = await only_node(client)
        own.stop()
        keys, data = ids(2), blocks(2, 4096)
        assert await client.lookup(keys) == 0  # no index: a miss, not an error
        await asyncio.sleep(0.5)
        assert httpx.get(f"{store.http}/ready").json()["status"] == "degraded"
        await node.reserve([BlockSpec(id=k, size=4096) for k in keys], 1)
        await node.write(keys, data)
        await node.commit(keys)
        out = [np.zeros(4096, np.uint8) for _ in keys]
        await node.get(keys, out)
        assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
        own.start()  # same port, empty state

        async def back() -> bool:
            return await client.lookup(keys) == 2 and len(await client.nodes(force=True)) == 1

        await wait_until(back)
        await client.close()
        await redis.aclose()
    finally:
        own.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_thousands_of_small_blocks_in_one_frame(transport: str, one_store: OneStore) -> None:
    """A frame header over 64 KiB and thousands of sub-threshold segments (UCX stages them)."""
    _, client = one_store(transport)
    data, keys = blocks(3000, 256), ids(3000)
    await client.put(keys, data, num_layers=2)
    out = [np.zeros(256, np.uint8) for _ in keys]
    await client.get(keys, out)
    assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_pending_read_fails_fast_when_the_store_dies(
    transport: str, one_store: OneStore
) -> None:
    """A lost peer is an error on the pending operation, long before its own wait bound."""
    store, client = one_store(transport)
    keys = ids(2)
    handle = await client.begin_put(keys, [4096, 4096], num_layers=4)
    out = [np.zeros(4096, np.uint8) for _ in keys]

    async def read() -> list[int]:
        return [layer async for layer in client.stream(keys, out, num_layers=4, wait_s=60)]

    reader = asyncio.create_task(read())
    await handle.write(keys, [np.ones(1024, np.uint8)] * 2, (0, 1))
    await asyncio.sleep(0.3)  # the reader now waits for layer 1
    started = time.monotonic()
    store.proc.kill()
    with pytest.raises(TransportError):
        await asyncio.wait_for(reader, 30)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_replicated_put_and_stream_survive_a_node_kill_mid_transfer(
    transport: str, start_store: StoreFactory, make_client: ClientFactory
) -> None:
    """R=2: the writer drops the dead replica, the reader re-reads from the other."""
    p = prefix()
    nodes = {n.instance_id: n for n in (start_store(transport, p) for _ in range(3))}
    writer = make_client(transport, p, replication=2, timeout_s=5.0)
    reader = make_client(transport, p, replication=2, timeout_s=5.0)
    layers, size = 8, 8 * 4096
    keys, data = ids(12), blocks(12, size)
    handle = await writer.begin_put(keys, [size] * len(keys), num_layers=layers)
    out = [np.zeros(size, np.uint8) for _ in keys]
    task, seen = start_stream(reader, keys, out, layers, wait_s=30)
    lb = size // layers
    for layer in range(layers):
        if layer == layers // 2:
            await wait_until(lambda: len(seen) == layers // 2)
            # the node the reader streams keys[0] from (its first-ranked holder)
            first = rank(keys[0], await reader.nodes())[0]
            nodes[first.instance_id].proc.kill()
        chunk = [d[layer * lb : (layer + 1) * lb] for d in data]
        await handle.write(keys, chunk, (layer, layer + 1))
    await handle.commit()
    await asyncio.wait_for(task, 30)
    assert seen == list(range(layers))
    assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_killed_node_restarts_on_its_ports_at_once(
    transport: str, start_store: StoreFactory, make_client: ClientFactory
) -> None:
    """Its old connections sit in TIME_WAIT; the restarted listener still binds."""
    p = prefix()
    node = start_store(transport, p)
    client = make_client(transport, p)
    keys, data = ids(8), blocks(8, 4096)
    await client.put(keys, data)
    out = [np.zeros(4096, np.uint8) for _ in keys]
    await client.get(keys, out)
    node.proc.kill()
    node.proc.start().wait_ready()
    fresh = make_client(transport, p)
    await fresh.put(keys, data)
    await fresh.get(keys, out)
    assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
