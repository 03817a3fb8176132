"""Where CUDA is present, the shared arena is pinned in place (cudaHostRegister of the
/dev/shm mapping), so a GPU copies straight from the memory same-host clients map.
Skipped on machines without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from services.kvstore.arena import Arena, cuda_present
from shared.kvstore.local_arena import LocalArena

pytestmark = pytest.mark.skipif(not cuda_present(), reason="needs a CUDA device")
MB = 1 << 20


def test_the_shared_arena_is_pinned_in_place_and_gpus_copy_from_it() -> None:
    import torch

    arena = Arena(64 * MB, 8 * MB, shared=True)
    path = arena.shm_path
    assert path is not None and arena.pinned
    assert torch.from_numpy(arena.buffer).is_pinned()  # the mapping itself is registered
    slot = arena.allocate(4 * MB)
    assert slot is not None
    arena.view(slot)[:] = np.arange(4 * MB, dtype=np.uint64).astype(np.uint8)
    on_gpu = torch.empty(4 * MB, dtype=torch.uint8, device="cuda")
    on_gpu.copy_(torch.from_numpy(arena.view(slot)), non_blocking=True)
    back = torch.zeros(4 * MB, dtype=torch.uint8, pin_memory=True)
    back.copy_(on_gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert np.array_equal(back.numpy(), arena.view(slot))
    # a client's own mapping of the file holds the same bytes
    client = LocalArena.open(str(path), arena.capacity)
    seen = np.zeros(4 * MB, np.uint8)
    client.read_into(seen, slot.offset)
    assert np.array_equal(seen, back.numpy())
    client.close()
    arena.close()
    assert not path.exists()
