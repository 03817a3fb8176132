"""CUDA tensors as store buffers (skipped without a GPU): whole blocks put from and got
into device memory, by DMA through a same-host store's arena and through pinned memory
over the socket, byte for byte."""

from __future__ import annotations

import pytest
import torch

from tests.services.kvstore.conftest import ClientFactory, StoreFactory, prefix
from tests.services.kvstore.test_node import ids

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("shm", [True, False])
async def test_device_blocks_round_trip(
    shm: bool, start_store: StoreFactory, make_client: ClientFactory
) -> None:
    p = prefix()
    start_store("tcp", p)
    client = make_client("tcp", p, shm=shm)
    size, layers = 368_640, 30
    data = torch.randint(0, 256, (6, size), dtype=torch.uint8, device="cuda")
    keys = ids(6)
    await client.put(keys[:3], list(data[:3]), num_layers=layers)
    handle = await client.begin_put(keys[3:], [size] * 3, num_layers=layers)
    await handle.write(keys[3:], list(data[3:]))
    await handle.commit()
    out = torch.zeros_like(data)
    await client.get(keys, list(out))
    assert torch.equal(out, data)
    (node,) = await client.nodes(force=True)
    assert node.local is shm
