"""CUDA tensors as KV store buffers.

The store client takes a CUDA tensor wherever it takes a buffer for a whole-block
``get``, ``put`` or ``write`` (not for layer streams). Bytes then move by DMA: straight
between the tensor and a same-host node's pinned arena
(:class:`~shared.kvstore.local_arena.LocalArena`), or through pinned host memory when
the node is reached by socket. :class:`DeviceDMA` runs those copies on its own CUDA
stream and waits for them by event, never by synchronizing the device.

Ownership: a device buffer handed to the client is read (put/write) or written (get)
until the awaited call returns, like any buffer; its producer must have finished
writing it before the call (the connector waits for the compute's event first). No
torch import happens here until a CUDA tensor is actually seen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shared.transport.base import Buffer, as_bytes_view

if TYPE_CHECKING:
    import torch


def is_device(buf: Buffer) -> bool:
    """A CUDA tensor (anything else is host memory the transports read directly)."""
    return getattr(buf, "is_cuda", False) is True


def nbytes(buf: Buffer) -> int:
    """The bytes ``buf`` moves; a host buffer that no transport takes (not contiguous)
    raises ValueError here, before a request names its size."""
    if hasattr(buf, "element_size"):  # a torch tensor: no view made (0.2 us, not 4)
        if not is_device(buf) and not buf.is_contiguous():
            raise ValueError("transport buffers must be contiguous")
        return int(buf.numel() * buf.element_size())
    return as_bytes_view(buf).nbytes


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as its flat ``uint8`` view (no copy)."""
    import torch

    if not t.is_contiguous():
        raise ValueError("device buffers must be contiguous")
    return t.reshape(-1).view(torch.uint8)


async def uncancellable(run: Callable[[], None]) -> None:
    """Run ``run`` in a thread and wait until it finished, cancelled or not.

    A store unpins blocks when told (or when the connection closes), so a copy
    must never be left running behind a cancelled caller. A cancellation that
    arrived meanwhile is re-raised afterwards."""
    future = asyncio.get_running_loop().run_in_executor(None, run)
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)  # raises the copy's own error, if any
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    future.result()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(
        a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def coalesce(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Merge runs of copies whose destinations and sources both continue where the last
    ended (consecutive pool slots to consecutive arena slots, say) into one copy each:
    a DMA of a few hundred kilobytes pays as much in launch cost as in transfer."""
    import torch

    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in pairs:
        if out:
            pd, ps = out[-1]
            n = pd.numel()
            if (
                dst.data_ptr() == pd.data_ptr() + n
                and src.data_ptr() == ps.data_ptr() + n
                and _same_storage(dst, pd)
                and _same_storage(src, ps)
            ):
                size = n + dst.numel()
                out[-1] = (torch.as_strided(pd, (size,), (1,)), torch.as_strided(ps, (size,), (1,)))
                continue
        out.append((dst, src))
    return out


class DeviceDMA:
    """Copies between CUDA tensors and host memory, on one stream per device."""

    def __init__(self) -> None:
        self._streams: dict[Any, Any] = {}

    async def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for each ``(dst, src)`` (flat ``uint8``, one side CUDA),
        queued on this object's stream after the work already queued on the device's
        current stream; returns once every copy finished (even if cancelled)."""
        import torch

        if not pairs:
            return
        device = next(t.device for pair in pairs for t in pair if t.is_cuda)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        done = torch.cuda.Event(blocking=True)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for dst, src in coalesce(pairs):
                dst.copy_(src, non_blocking=True)
            done.record(stream)
        await uncancellable(done.synchronize)

    async def to_host(self, bufs: Sequence[Buffer]) -> list[Buffer]:
        """``bufs`` with every CUDA tensor replaced by a pinned host copy of its bytes."""
        if not any(is_device(b) for b in bufs):
            return list(bufs)
        import torch

        out: list[Buffer] = []
        pairs = []
        for b in bufs:
            if is_device(b):
                src = flat_bytes(b)
                host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
                pairs.append((host, src))
                out.append(host)
            else:
                out.append(b)
        await self.copy(pairs)
        return out

    def host_landing(self, bufs: Sequence[Buffer]) -> list[Buffer]:
        """Where to receive ``bufs``: a pinned host buffer for each CUDA tensor (then
        :meth:`land`), the buffer itself for host memory."""
        if not any(is_device(b) for b in bufs):
            return list(bufs)
        import torch

        return [
            torch.empty(nbytes(b), dtype=torch.uint8, pin_memory=True) if is_device(b) else b
            for b in bufs
        ]

    async def land(self, bufs: Sequence[Buffer], landing: Sequence[Buffer]) -> None:
        """Copy what :meth:`host_landing` received into the CUDA tensors of ``bufs``."""
        await self.copy(
            [(flat_bytes(b), h) for b, h in zip(bufs, landing, strict=True) if is_device(b)]
        )
