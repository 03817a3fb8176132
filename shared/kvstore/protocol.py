"""KV store wire protocol: the JSON headers of data-plane frames, defined once.

Every request is one frame whose header is a JSON object with an ``op`` field;
payload segments follow the rules of each op. Every response header carries
``ok``; a refused op answers ``ok: false`` with an ``error`` of a stable
``code`` (see :mod:`shared.errors`, ``KVStoreError`` subclasses).

Payload rules (one segment per block id, in the order of ``ids``):
- ``write`` whole blocks: each segment is the block's full size.
- ``put``: like a whole-block ``write`` of freshly reserved blocks, committed
  on arrival; blocks the node already holds (or is receiving from another
  writer) are drained and skipped. The reply's ``statuses`` say which.
- ``write`` with ``layers=[a, b)``: each segment is bytes
  ``[a*layer_bytes, b*layer_bytes)`` of its block (layer-major layout).
- ``get`` answers the same way: one ``chunk`` frame with whole blocks, or,
  with ``stream: true``, one ``chunk`` frame per layer as the layer becomes
  available, then a final ``done`` frame once every block is committed. A
  streamed reader may use layers early, but only trusts them after ``done``.
  A stream's ``layer_ids`` (ascending) name the layers it sends, instead of
  ``layers`` or all of them.

Same-host clients (``local: true``; the node's hello reply named its shared
arena, see :mod:`shared.kvstore.local_arena`) send and receive no payload:
- ``write``/``put`` with ``local`` are answered with ``offsets`` (where each
  block's bytes, or its ``layers`` slice, lie in the arena; null for a put's
  block the node holds already). The client copies its bytes there, then sends
  ``ack``; the node marks them written. A ``write``'s ``ack`` is not answered
  (a ``commit`` of those blocks, on any connection, first waits for writes in
  flight to them); a ``put``'s ``ack`` is answered with the put's usual reply
  once the blocks are committed. A ``write``'s ``sizes`` are the byte counts
  the client will copy, checked as a payload's would be.
- ``get`` with ``local`` answers ``offsets`` (and ``sizes``) instead of a
  payload; each ``chunk`` of a stream likewise. The client copies, then sends
  an ``ack``, not answered: after a whole-block read at once, after a stream's
  final frame (``done`` or an error) if it received any chunk.
- Between the reply with offsets and the ``ack`` the node keeps those blocks
  pinned: never freed or reused, whatever revokes, expires or evicts them
  meanwhile. If the connection breaks instead, the pin ends with it. So a
  client must finish every copy before it sends ``ack`` or closes.
- A frame other than ``ack`` where one is due is refused (``bad_request``);
  the pin ends there.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

HexId = Annotated[str, Field(pattern=r"^[0-9a-f]{8,64}$")]
MAX_IDS = 8192
Ids = Annotated[list[HexId], Field(min_length=1, max_length=MAX_IDS)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LayerRange(_Wire):
    start: Annotated[int, Field(ge=0)]
    stop: Annotated[int, Field(ge=1)]

    @model_validator(mode="after")
    def _ordered(self) -> LayerRange:
        if self.stop <= self.start:
            raise ValueError("layers: stop must be greater than start")
        return self


class HelloAuth(_Wire):
    """Proof of the cluster secret (see :mod:`shared.cluster.auth`)."""

    nonce: Annotated[str, Field(min_length=32, max_length=32)]
    ts: float
    mac: Annotated[str, Field(min_length=64, max_length=64)]


class Hello(_Wire):
    """A connection's first frame: who the client is, and its proof of the secret.

    ``shm``: the client would use the node's shared arena if on the same host."""

    op: Literal["hello"] = "hello"
    client_id: Annotated[str, Field(min_length=1, max_length=128)]
    auth: HelloAuth | None = None
    shm: bool = False


class SharedArena(_Wire):
    """Where a node's arena can be mapped: ``path`` of ``size`` bytes, valid on ``host``."""

    path: Annotated[str, Field(min_length=1, max_length=4096)]
    size: Annotated[int, Field(gt=0)]
    host: Annotated[str, Field(min_length=1, max_length=512)]


class BlockSpec(_Wire):
    id: HexId
    size: Annotated[int, Field(gt=0)]


class Reserve(_Wire):
    op: Literal["reserve"] = "reserve"
    blocks: Annotated[list[BlockSpec], Field(min_length=1, max_length=MAX_IDS)]
    num_layers: Annotated[int, Field(ge=1, le=4096)] = 1
    ttl_s: Annotated[float, Field(gt=0, le=3600)] = 30.0

    @model_validator(mode="after")
    def _divisible(self) -> Reserve:
        for block in self.blocks:
            if block.size % self.num_layers:
                raise ValueError(
                    f"block {block.id} size {block.size} is not a multiple "
                    f"of num_layers {self.num_layers}"
                )
        return self


class Put(Reserve):
    """Reserve + write whole blocks + commit in one frame (one segment per block)."""

    op: Literal["put"] = "put"  # type: ignore[assignment]
    local: bool = False


class Write(_Wire):
    op: Literal["write"] = "write"
    ids: Ids
    layers: LayerRange | None = None
    local: bool = False  # no payload: the client copies (``sizes``: bytes per id)
    sizes: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_IDS)] | None = None

    @model_validator(mode="after")
    def _sized(self) -> Write:
        if self.local and (self.sizes is None or len(self.sizes) != len(self.ids)):
            raise ValueError("a local write needs one size per id")
        return self


class Commit(_Wire):
    op: Literal["commit"] = "commit"
    ids: Ids


class Revoke(_Wire):
    op: Literal["revoke"] = "revoke"
    ids: Ids


class Get(_Wire):
    op: Literal["get"] = "get"
    ids: Ids
    layers: LayerRange | None = None
    # a stream of only these layers (ascending), instead of a range: a reader that
    # needs some layers of a block and not others (a sliding window's, see
    # shared.kv.layer_groups) moves no bytes it would drop
    layer_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=4096)] | None = None
    stream: bool = False
    wait_s: Annotated[float, Field(ge=0, le=300)] = 0.0
    local: bool = False

    @model_validator(mode="after")
    def _layer_ids(self) -> Get:
        ids = self.layer_ids
        if ids is None:
            return self
        if not self.stream or self.layers is not None:
            raise ValueError("layer_ids: only for a stream, and not with layers")
        if not ids or any(b <= a for a, b in pairwise(ids)):
            raise ValueError("layer_ids: ascending and distinct, at least one")
        return self


class Ack(_Wire):
    """A local client finished its copies (``ok``: all of them succeeded)."""

    op: Literal["ack"] = "ack"
    ok: bool = True


class Lookup(_Wire):
    op: Literal["lookup"] = "lookup"
    ids: Ids


class Lease(_Wire):
    op: Literal["lease"] = "lease"
    ids: Ids
    ttl_s: Annotated[float, Field(gt=0, le=3600)] = 30.0


class Release(_Wire):
    op: Literal["release"] = "release"
    lease_id: Annotated[str, Field(min_length=1, max_length=64)]


class Ping(_Wire):
    op: Literal["ping"] = "ping"


Request = Annotated[
    Hello | Reserve | Put | Write | Commit | Revoke | Get | Lookup | Lease | Release | Ping | Ack,
    Field(discriminator="op"),
]
REQUEST = TypeAdapter(Request)

BlockStatus = Literal["reserved", "exists", "pending"]


class ErrorBody(_Wire):
    code: str
    message: str
    ids: list[str] = []


class Response(_Wire):
    """Every reply. Op-specific fields are optional so one type parses all."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ok: bool = True
    error: ErrorBody | None = None
    kind: Literal["reply", "chunk", "done"] = "reply"
    statuses: list[BlockStatus] | None = None  # reserve
    num_hit: int | None = None  # lookup
    lease_id: str | None = None  # lease
    layers: LayerRange | None = None  # get chunk
    sizes: list[int] | None = None  # get: block sizes (whole-block reads)
    num_layers: list[int] | None = None  # get: layers per block
    stats: dict[str, float] | None = None  # ping
    arena: SharedArena | None = None  # hello with shm, from a node whose arena is shared
    offsets: list[int | None] | None = None  # local ops: arena offset per block


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json(exclude_none=True).encode()


def decode_response(raw: bytes) -> Response:
    return Response.model_validate_json(raw)
