"""A real KV store process and clients on the same host: block bytes go through the
store's /dev/shm arena, the socket carries control messages only; a client that is
not on the store's host, or a store with sharing off, uses the socket."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

from shared.kvstore import local_arena
from shared.kvstore.client import KVStoreClient
from shared.kvstore.node_client import NodeClient
from tests.services.kvstore.conftest import (
    TRANSPORTS,
    ClientFactory,
    OneStore,
    StoreFactory,
    StoreNode,
    prefix,
)
from tests.services.kvstore.test_node import blocks, ids, start_stream, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="session")
SHM = Path("/dev/shm")


def counter(store: StoreNode, name: str) -> float:
    text = httpx.get(f"{store.http}/metrics", timeout=10).text
    found = re.search(rf"^baton_kvstore_{name}_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def arena_files(store: StoreNode) -> list[Path]:
    proc = store.proc.proc
    assert proc is not None
    return sorted(SHM.glob(f"baton-kv-{proc.pid}-*"))


async def only_node(client: KVStoreClient) -> NodeClient:
    (node,) = await client.nodes(force=True)
    return node


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_local_client_round_trips_are_byte_exact(
    transport: str, start_store: StoreFactory, make_client: ClientFactory
) -> None:
    p = prefix()
    store = start_store(transport, p)
    writer, reader = make_client(transport, p), make_client(transport, p)
    layers, size = 30, 46_080 * 16
    # whole blocks: put, get, a layer range
    data, keys = blocks(5, size), ids(5)
    await writer.put(keys, data, num_layers=layers)
    out = [np.zeros(size, np.uint8) for _ in keys]
    await reader.get(keys, out)
    assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
    lb = size // layers
    part = [np.zeros(3 * lb, np.uint8) for _ in keys]
    await reader.get(keys, part, layers=(4, 7))
    assert all(np.array_equal(a[4 * lb : 7 * lb], b) for a, b in zip(data, part, strict=True))
    # layer by layer, to a stream that waits for layers the writer has not written yet
    data, keys = blocks(6, size), ids(6, 1)
    handle = await writer.begin_put(keys, [size] * 6, num_layers=layers)
    streamed = [np.zeros(size, np.uint8) for _ in keys]
    task, seen = start_stream(reader, keys, streamed, layers, wait_s=20)
    for layer in range(layers):
        chunk = [d[layer * lb : (layer + 1) * lb] for d in data]
        await handle.write(keys, chunk, (layer, layer + 1))
        if layer == 3:
            await wait_until(lambda: len(seen) >= 4)  # the reader copied layers early
    await handle.commit()
    await asyncio.wait_for(task, 20)
    assert seen == list(range(layers))
    assert all(np.array_equal(a, b) for a, b in zip(data, streamed, strict=True))
    assert (await only_node(writer)).local and (await only_node(reader)).local
    moved = 5 * size + 6 * size  # both puts
    assert counter(store, "local_bytes_in") == moved == counter(store, "bytes_in")


async def test_a_client_on_another_host_uses_the_socket(
    one_store: OneStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_arena, "host_identity", lambda: "another-boot/another-host")
    store, client = one_store("tcp")
    size = 46_080 * 16
    data, keys = blocks(4, size), ids(4)
    await client.put(keys, data, num_layers=30)
    out = [np.zeros(size, np.uint8) for _ in keys]
    await client.get(keys, out)
    assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
    assert not (await only_node(client)).local
    assert counter(store, "local_bytes_in") == 0 and counter(store, "bytes_in") == 4 * size


async def test_a_store_with_sharing_off_has_no_arena_file(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    p = prefix()
    store = start_store("tcp", p, shm="false")
    client = make_client("tcp", p)
    data, keys = blocks(2, 8192), ids(2)
    await client.put(keys, data, num_layers=2)
    out = [np.zeros(8192, np.uint8) for _ in keys]
    await client.get(keys, out)
    assert all(np.array_equal(a, b) for a, b in zip(data, out, strict=True))
    assert not (await only_node(client)).local
    assert arena_files(store) == []


async def test_the_arena_file_goes_at_stop_and_a_crashed_stores_at_the_next_start(
    start_store: StoreFactory, make_client: ClientFactory
) -> None:
    p = prefix()
    stopped, crashed = start_store("tcp", p), start_store("tcp", p)
    (stopped_file,), (crashed_file,) = arena_files(stopped), arena_files(crashed)
    client = make_client("tcp", p)
    await client.put(ids(2), blocks(2, 8192), num_layers=1)  # mapped by this client too
    assert stopped.proc.stop() is not None  # SIGTERM: clean shutdown
    assert not stopped_file.exists()
    crashed.proc.kill()  # SIGKILL: nothing cleans up
    assert crashed_file.exists()
    start_store("tcp", prefix())
    assert not crashed_file.exists()  # the next store removed the dead one's file
    await client.close()
