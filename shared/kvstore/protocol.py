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
"""

from __future__ import annotations

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
    """A connection's first frame: who the client is, and its proof of the secret."""

    op: Literal["hello"] = "hello"
    client_id: Annotated[str, Field(min_length=1, max_length=128)]
    auth: HelloAuth | None = None


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


class Write(_Wire):
    op: Literal["write"] = "write"
    ids: Ids
    layers: LayerRange | None = None


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
    stream: bool = False
    wait_s: Annotated[float, Field(ge=0, le=300)] = 0.0


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
    Hello | Reserve | Put | Write | Commit | Revoke | Get | Lookup | Lease | Release | Ping,
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


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json(exclude_none=True).encode()


def decode_response(raw: bytes) -> Response:
    return Response.model_validate_json(raw)
