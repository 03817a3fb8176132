"""UCX transport through UCXX (the default data plane).

Framing over UCX tag messages, all on the endpoint's own tag so order holds:

1. control message: preamble + header + segment size table. Receivers post a
   64 KiB buffer; a larger control block is announced by a preamble-only
   message (flag ``LARGE``) followed by the rest at its exact size.
2. the payload, as *groups* of segments. A segment of at least
   ``COALESCE_BYTES`` travels alone, straight from the sender's buffer into the
   receiver's (zero copy; UCX picks eager or rendezvous by size). Runs of
   smaller segments (e.g. one layer's slice of many blocks) are gathered into
   one message through a per-connection staging buffer, because one UCX
   message per 12-24 KiB slice costs more than the copy. Both sides derive
   the same groups from the size table alone.

Tuning (chosen on a 2-vCPU VM, see benchmarks/kv_transfer_bench.py):

- progress: event-driven from the asyncio loop (:mod:`shared.transport.ucx_progress`)
  instead of UCXX's modes, which either busy-wait every pending request (a
  store with one idle client burnt a core) or hand every completion through a
  notifier thread (~1 ms round trips). ``UCXPY_PROGRESS_MODE`` set in the
  environment selects UCXX's own waiting instead.
- TCP segments of 4 MiB instead of 8 KiB (fewer trips through bounce buffers).
- transports ``tcp,cma``: the only ones here that support UCXX's endpoint
  error handling (a dead peer is an error, not a hang), with cma's
  single-copy ``get_zcopy`` rendezvous for large messages between processes
  on one host.
- every message of a frame is posted at once and awaited together.

Any ``UCX_*`` environment variable overrides these.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.errors import PeerLostError, ProtocolError, TransportError, TransportTimeoutError
from shared.ports import check_port_free
from shared.transport.base import (
    PREAMBLE,
    Buffer,
    Connection,
    Frame,
    Handler,
    Listener,
    Transport,
    as_bytes_view,
    check_into,
    decode_preamble,
    decode_sizes,
    encode_preamble,
)
from shared.transport.ucx_progress import Completions, Posted, Poster, install

log = logging.getLogger(__name__)

CONTROL_INLINE_BYTES = 64 << 10
COALESCE_BYTES = 256 << 10
# after an abort, how long a cancelled operation waits for UCX to release its buffers
SETTLE_S = 5.0
FLAG_LARGE = 1
DEFAULT_UCX_OPTIONS = {
    "TLS": "tcp,cma",
    "RNDV_SCHEME": "get_zcopy",
    "TCP_TX_SEG_SIZE": "4M",
    "TCP_RX_SEG_SIZE": "4M",
    "WARN_UNUSED_ENV_VARS": "n",
    # a restarted listener binds its port while the old connections sit in TIME_WAIT
    # (SO_REUSEADDR; a port another process listens on is still refused)
    "CM_REUSEADDR": "y",
}


@dataclass(frozen=True)
class Group:
    """Segments ``[start, stop)`` travel as one UCX message."""

    start: int
    stop: int
    nbytes: int

    @property
    def staged(self) -> bool:
        return self.stop - self.start > 1


def plan_groups(sizes: Sequence[int], coalesce: int = COALESCE_BYTES) -> list[Group]:
    """Deterministic grouping both ends compute from the size table."""
    groups: list[Group] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        if size >= coalesce:
            if i > start:
                groups.append(Group(start, i, acc))
            groups.append(Group(i, i + 1, size))
            start, acc = i + 1, 0
            continue
        acc += size
        if acc >= coalesce:
            groups.append(Group(start, i + 1, acc))
            start, acc = i + 1, 0
    if start < len(sizes):
        groups.append(Group(start, len(sizes), acc))
    return [g for g in groups if g.nbytes > 0]


async def _settle(posted: Sequence[Posted], peer: str) -> None:
    pending = [p.settled for p in posted if not p.settled.done()]
    if not pending:
        return
    _, late = await asyncio.wait(pending, timeout=SETTLE_S)
    if late:  # their buffers stay referenced by Completions until UCX completes them
        log.warning("%d UCX requests to %s still pending after abort", len(late), peer)


def _ucx() -> Any:
    return importlib.import_module("ucxx")


class UcxConnection(Connection):
    def __init__(
        self,
        endpoint: Any,
        peer: str,
        errors: tuple[type[BaseException], ...],
        poster: Poster | None,
    ):
        self._ep = endpoint
        self._errors = errors
        self._lost: tuple[type[BaseException], ...] = (*errors, ConnectionError)
        self._poster = poster
        self._closed = False
        self._control = np.empty(CONTROL_INLINE_BYTES, dtype=np.uint8)
        self._staging = np.empty(0, dtype=np.uint8)
        self.peer = peer

    @property
    def closed(self) -> bool:
        return self._closed or self._ep.closed

    def _stage(self, nbytes: int) -> np.ndarray:
        if self._staging.nbytes < nbytes:
            self._staging = np.empty(nbytes, dtype=np.uint8)
        return self._staging[:nbytes]

    async def _io(self, op: str, buffers: list[np.ndarray]) -> None:
        """Post every message at once (UCX keeps their order on the endpoint) and
        wait for all of them."""
        if self.closed:
            raise PeerLostError(f"connection to {self.peer} is closed")
        posted: list[Posted] = []
        try:
            if self._poster is not None:
                posted = [self._poster.post(self._ep, op, b) for b in buffers]
                futures = [p.result for p in posted]
                self._poster.kick(self._ep)
            else:  # UCXX's own waiting (UCXPY_PROGRESS_MODE set)
                call = self._ep.send if op == "send" else self._ep.recv
                futures = [asyncio.ensure_future(call(b)) for b in buffers]
            results = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:
            # A cancelled UCX request may still be matched later: abort the
            # endpoint (UCXX cancels its requests) and wait until UCX has let go
            # of every buffer, so nothing writes into the caller's memory (KV
            # blocks that are about to be reused) after this returns.
            self._abort()
            await _settle(posted, self.peer)
            raise
        except self._lost as exc:
            self._abort()
            raise PeerLostError(f"connection to {self.peer} lost: {exc}") from exc
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            self._abort()
            raise PeerLostError(f"connection to {self.peer} lost: {failed}") from failed

    def _messages(
        self, views: Sequence[memoryview]
    ) -> tuple[list[np.ndarray], list[tuple[Group, np.ndarray]]]:
        """One buffer per UCX message for ``views``, and the staged groups' areas."""
        groups = plan_groups([v.nbytes for v in views])
        stage = self._stage(sum(g.nbytes for g in groups if g.staged))
        messages: list[np.ndarray] = []
        staged: list[tuple[Group, np.ndarray]] = []
        used = 0
        for group in groups:
            if not group.staged:
                messages.append(np.frombuffer(views[group.start], dtype=np.uint8))
                continue
            area = stage[used : used + group.nbytes]
            used += group.nbytes
            messages.append(area)
            staged.append((group, area))
        return messages, staged

    async def send(self, header: bytes, segments: Sequence[Buffer] = ()) -> None:
        views = [as_bytes_view(s) for s in segments]
        sizes = [v.nbytes for v in views]
        control = encode_preamble(header, sizes)
        messages: list[np.ndarray]
        if len(control) <= CONTROL_INLINE_BYTES:
            messages = [np.frombuffer(control, dtype=np.uint8)]
        else:
            pre = bytearray(control[: PREAMBLE.size])
            pre[6] |= FLAG_LARGE  # flags field of the preamble
            messages = [
                np.frombuffer(bytes(pre), dtype=np.uint8),
                np.frombuffer(control[PREAMBLE.size :], dtype=np.uint8),
            ]
        payload, staged = self._messages(views)
        for group, area in staged:  # gather small segments into their staging area
            offset = 0
            for view in views[group.start : group.stop]:
                area[offset : offset + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
                offset += view.nbytes
        messages += payload
        await self._io("send", messages)

    async def recv(self) -> Frame:
        await self._io("recv", [self._control])
        raw = self._control
        try:
            header_len, nseg = decode_preamble(raw[: PREAMBLE.size].tobytes())
        except ProtocolError:
            self._abort()
            raise
        rest_len = header_len + 8 * nseg
        if raw[6] & FLAG_LARGE:
            rest = np.empty(rest_len, dtype=np.uint8)
            await self._io("recv", [rest])
        else:
            if PREAMBLE.size + rest_len > CONTROL_INLINE_BYTES:
                self._abort()
                raise ProtocolError("inline control block over its limit")
            rest = raw[PREAMBLE.size : PREAMBLE.size + rest_len]
        data = rest.tobytes()
        return Frame(data[:header_len], decode_sizes(data[header_len:]))

    async def recv_segments(self, frame: Frame, into: Sequence[Buffer]) -> None:
        views = check_into(frame, into)
        messages, staged = self._messages(views)
        if messages:
            await self._io("recv", messages)
        for group, area in staged:
            offset = 0
            for view in views[group.start : group.stop]:
                np.frombuffer(view, dtype=np.uint8)[:] = area[offset : offset + view.nbytes]
                offset += view.nbytes

    def _abort(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._ep.abort()
            except self._errors as exc:
                log.debug("abort of %s: %s", self.peer, exc)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._ep.close()
        except self._errors as exc:
            log.debug("close of %s: %s", self.peer, exc)


class UcxListener(Listener):
    def __init__(self, listener: Any, tasks: set[asyncio.Task[None]]):
        self._listener = listener
        self._tasks = tasks
        self.port = int(listener.port)

    async def close(self) -> None:
        self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class UcxTransport(Transport):
    """Owns the process's UCXX context (UCXX keeps one per process)."""

    name = "ucx"

    def __init__(self, options: dict[str, str] | None = None):
        ucxx = _ucx()
        ucxx_mode = os.environ.get("UCXPY_PROGRESS_MODE")  # set: UCXX's own waiting
        completions = Completions()
        if ucxx_mode is None:
            install(completions)
        try:
            ucxx.init(
                options={**DEFAULT_UCX_OPTIONS, **(options or {})},
                env_takes_precedence=True,
                progress_mode=ucxx_mode or "blocking",
                enable_python_future=bool(ucxx_mode and ucxx_mode.startswith("thread")),
            )
        except RuntimeError as exc:  # UCXX keeps one context per process
            log.info("reusing this process's UCX context (%s)", exc)
        self._ucxx = ucxx
        self._poster = None if ucxx_mode else Poster(completions)
        exc_mod = importlib.import_module("ucxx.exceptions")
        self._errors: tuple[type[BaseException], ...] = (exc_mod.UCXError, exc_mod.UCXCanceled)

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        tasks: set[asyncio.Task[None]] = set()

        async def on_connect(endpoint: Any) -> None:
            peer = f"ucx-peer-{endpoint.uid:#x}"
            conn = UcxConnection(endpoint, peer, self._errors, self._poster)
            task = asyncio.current_task()
            if task is not None:
                tasks.add(task)
            try:
                await handler(conn)
            finally:
                if task is not None:
                    tasks.discard(task)
                await conn.close()

        # UCX binds every interface and only logs why a bind failed: a port another
        # process listens on is found here first, as one clear error (TIME_WAIT is no
        # obstacle: the same SO_REUSEADDR as UCX_CM_REUSEADDR)
        check_port_free("0.0.0.0", port, "data plane")
        try:
            listener = self._ucxx.create_listener(on_connect, port=port or None)
        except self._errors as exc:
            raise TransportError(f"cannot listen on UCX port {port}: {exc}") from exc
        return UcxListener(listener, tasks)

    async def connect(self, host: str, port: int, *, timeout: float = 5.0) -> Connection:
        try:
            async with asyncio.timeout(timeout):
                ep = await self._ucxx.create_endpoint(host, port, connect_timeout=timeout)
        except TimeoutError as exc:
            raise TransportTimeoutError(f"UCX connect to {host}:{port} timed out") from exc
        except self._errors as exc:
            raise PeerLostError(f"cannot connect to {host}:{port} over UCX: {exc}") from exc
        return UcxConnection(ep, f"{host}:{port}", self._errors, self._poster)

    async def shutdown(self) -> None:
        self._ucxx.stop_notifier_thread()
