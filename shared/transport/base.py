"""The data-plane transport boundary: framed messages between two processes.

A *frame* is a small header (opaque bytes; the KV store protocol puts JSON
there) plus zero or more *segments* of payload. The segment sizes travel in the
frame's preamble, so a receiver knows them before it posts buffers and can
drain a payload it does not want without understanding the header.

Ownership and safety:

- ``send(header, segments)`` reads the segment buffers until it returns; the
  caller must not modify them before then. Nothing is copied where the
  implementation can avoid it (TCP gathers with ``sendmsg``; UCX sends each
  large segment straight from its buffer).
- ``recv_segments(frame, into)`` writes into the caller's buffers; their sizes
  must equal the frame's segment sizes. The bytes are safe to read once it
  returns. If it raises, the buffers hold undefined bytes and the connection is
  closed (a half-received payload cannot be resynchronised).
- One frame exchange at a time per connection: callers serialise (the KV
  store client keeps a pool of connections per peer for concurrency).
- A lost peer, a timeout or garbage on the wire raises a
  :class:`~shared.errors.TransportError` from every pending and later call;
  nothing hangs.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.errors import ProtocolError

MAGIC = b"BTKV"
WIRE_VERSION = 1
# magic, version, flags, header length, segment count
PREAMBLE = struct.Struct("<4sHHII")
MAX_HEADER_BYTES = 4 << 20
MAX_SEGMENTS = 1 << 16
MAX_SEGMENT_BYTES = 1 << 34

Buffer = Any  # anything exposing the buffer protocol (bytes, memoryview, numpy, CPU torch)


@dataclass(frozen=True)
class Frame:
    """A received frame whose payload (if any) is still on the wire."""

    header: bytes
    sizes: tuple[int, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(self.sizes)


def as_bytes_view(buf: Buffer) -> memoryview:
    """A flat, byte-typed view of ``buf`` (no copy)."""
    if hasattr(buf, "is_contiguous") and hasattr(buf, "numpy"):  # CPU torch tensor
        if not buf.is_contiguous():
            raise ValueError("transport buffers must be contiguous")
        import torch  # already loaded: ``buf`` is a tensor

        if buf.dtype is torch.uint8 and buf.dim() == 1 and not buf.requires_grad:
            return memoryview(buf.numpy())  # a pool's block row: 1 us, not 4 (per block)
        buf = buf.detach().reshape(-1).view(torch.uint8).numpy()  # any dtype, bf16 included
    view = memoryview(buf)
    if not view.contiguous:
        raise ValueError("transport buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def encode_preamble(header: bytes, sizes: Sequence[int]) -> bytes:
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header of {len(header)} bytes is over {MAX_HEADER_BYTES}")
    if len(sizes) > MAX_SEGMENTS:
        raise ValueError(f"{len(sizes)} segments is over the limit of {MAX_SEGMENTS}")
    table = np.asarray(sizes, dtype="<u8").tobytes()
    return PREAMBLE.pack(MAGIC, WIRE_VERSION, 0, len(header), len(sizes)) + header + table


def decode_preamble(raw: bytes | bytearray | memoryview) -> tuple[int, int]:
    """``(header_len, num_segments)`` from the fixed preamble, or ProtocolError."""
    magic, version, _flags, header_len, nseg = PREAMBLE.unpack(bytes(raw[: PREAMBLE.size]))
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r}")
    if version != WIRE_VERSION:
        raise ProtocolError(f"unsupported wire version {version}")
    if header_len > MAX_HEADER_BYTES or nseg > MAX_SEGMENTS:
        raise ProtocolError("frame header or segment table over the limits")
    return header_len, nseg


def decode_sizes(raw: bytes | bytearray | memoryview) -> tuple[int, ...]:
    sizes = tuple(int(s) for s in np.frombuffer(raw, dtype="<u8"))
    if any(s > MAX_SEGMENT_BYTES for s in sizes):
        raise ProtocolError("segment over the size limit")
    return sizes


def check_into(frame: Frame, into: Sequence[Buffer]) -> list[memoryview]:
    views = [as_bytes_view(b) for b in into]
    got = tuple(v.nbytes for v in views)
    if got != frame.sizes:
        raise ValueError(f"receive buffers {got} do not match the frame's segments {frame.sizes}")
    for v in views:
        if v.readonly:
            raise ValueError("receive buffers must be writable")
    return views


class Connection(ABC):
    """One bidirectional framed stream to a peer. See the module docstring for rules."""

    peer: str

    @abstractmethod
    async def send(self, header: bytes, segments: Sequence[Buffer] = ()) -> None: ...

    @abstractmethod
    async def recv(self) -> Frame:
        """The next frame's header and segment sizes (the payload stays pending)."""

    @abstractmethod
    async def recv_segments(self, frame: Frame, into: Sequence[Buffer]) -> None:
        """Receive ``frame``'s payload into ``into`` (one buffer per segment)."""

    async def discard(self, frame: Frame) -> None:
        """Read and drop ``frame``'s payload (keeps the stream in sync)."""
        if frame.sizes:
            scratch = [np.empty(size, dtype=np.uint8) for size in frame.sizes]
            await self.recv_segments(frame, scratch)

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    @abstractmethod
    async def close(self) -> None:
        """Close; idempotent. Pending operations raise PeerLostError."""


Handler = Callable[[Connection], Awaitable[None]]


class Listener(ABC):
    port: int

    @abstractmethod
    async def close(self) -> None: ...


class Transport(ABC):
    """Factory for connections; one per process, created at start-up and injected."""

    name: str

    @abstractmethod
    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        """Accept connections on ``port`` (0 = any free port) and run ``handler`` on each."""

    @abstractmethod
    async def connect(self, host: str, port: int, *, timeout: float = 5.0) -> Connection: ...

    async def shutdown(self) -> None:
        """Release process-wide resources (UCX context); idempotent."""
        return None
