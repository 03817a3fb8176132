"""Wire types between the gateway and the prefill/decode workers (defined once, here).

Both workers answer with NDJSON streams: one event object per line, the
``event`` field names its type.

Prefill (``POST /v1/prefill``): ``accepted`` (KV reserved in the store, with
the transfer ids the decode side pulls) -> ``first_token`` -> ``committed``
(every layer of every block is in the store). Decode (``POST /v1/decode``):
``accepted`` (KV pool space reserved, pull started) -> ``token``... (the last
one carries ``finish_reason``; ``waiting`` while the request is queued or
preempted on an engine that keeps stepping); the first token reaches decode separately
(``POST /v1/decode/{request_id}/first_token``), as soon as prefill sampled it.
A draining decode ends a stream with ``migrate`` (where its KV is stored) for
the gateway to resume it elsewhere. Any stream may end with ``error``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from shared.engine.constraint import Constraint, ConstraintKind
from shared.engine.request import SampledToken, TokenLogprobs
from shared.engine.sampling_params import MAX_LOGPROBS, SamplingParams

REQUEST_ID_HEADER = "X-Request-Id"
BATON_REQUEST_ID_HEADER = "X-Baton-Request-Id"  # the gateway's own id, when a client sent its own
GATEWAY_HEADER = "X-Baton-Gateway"  # which gateway replica produced (or serves) a response


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConstraintSpec(_Wire):
    """:class:`Constraint` on the wire (the gateway checked it compiles)."""

    kind: ConstraintKind
    spec: str = ""

    def to_constraint(self) -> Constraint:
        return Constraint(self.kind, self.spec)

    @classmethod
    def of(cls, c: Constraint | None) -> ConstraintSpec | None:
        return None if c is None else cls(kind=c.kind, spec=c.spec)


class SamplingSpec(_Wire):
    """:class:`SamplingParams` on the wire; ``seed`` is always set (the gateway draws one)."""

    max_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0.0)
    top_p: float = Field(gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    seed: int
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[int, float] = {}
    constraint: ConstraintSpec | None = None

    def to_params(self, *, max_tokens: int | None = None) -> SamplingParams:
        """Stop strings stay at the gateway, which owns detokenization."""
        return SamplingParams(
            max_tokens=max_tokens or self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=self.logprobs,
            logit_bias=tuple(sorted(self.logit_bias.items())),
            constraint=self.constraint.to_constraint() if self.constraint else None,
        )


class WireToken(_Wire):
    """One sampled token, with its logprob and top alternatives when asked for."""

    id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None

    @classmethod
    def of(cls, token_id: int, lp: TokenLogprobs | None) -> WireToken:
        if lp is None:
            return cls(id=token_id)
        return cls(id=token_id, logprob=lp.logprob, top=[(t, v) for t, v in lp.top])

    def sampled(self) -> SampledToken:
        lp = None
        if self.logprob is not None:
            lp = TokenLogprobs(self.id, self.logprob, tuple((t, v) for t, v in self.top or ()))
        return SampledToken(self.id, lp)


class PrefillRequest(_Wire):
    request_id: str = Field(min_length=1, max_length=200)
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingSpec
    cache_salt: str | None = None
    # leading prompt tokens the cluster's index said the store holds as the gateway
    # routed the request (None: it did not look); 0 spares prefill the same lookup
    store_tokens_indexed: int | None = Field(default=None, ge=0)

    def decode_fields(self) -> dict[str, Any]:
        """The fields a :class:`DecodeRequest` of the same request shares with it."""
        return self.model_dump(exclude={"store_tokens_indexed"})


class DecodeRequest(_Wire):
    """A request prefilled elsewhere (``kv_ids``: one store id per prompt block, the
    partial tail included; its first token follows separately), or one resumed here
    after another decode instance died or drained: ``generated`` holds every token the
    client already has (the first included), ``kv_ids`` the stored full blocks (the
    watermark), and decode recomputes the rest and continues."""

    request_id: str = Field(min_length=1, max_length=200)
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingSpec
    cache_salt: str | None = None
    kv_ids: list[str] = []
    generated: list[int] = []
    wait_s: float = Field(default=120.0, gt=0)  # how long the pull waits for prefill

    @property
    def resumed(self) -> bool:
        return bool(self.generated)


class FirstToken(_Wire):
    token: WireToken


class Accepted(_Wire):
    event: Literal["accepted"] = "accepted"
    instance_id: str
    kv_ids: list[str] = []
    num_cached_tokens: int = 0
    # prefill: the prompt's KV will reach the store only once its first token is out
    # (sent whole after steps that take every core): a decode opened before then could
    # only wait, and its setup would take CPU from those steps
    kv_after_first_token: bool = False


class FirstTokenEvent(_Wire):
    event: Literal["first_token"] = "first_token"
    token: WireToken
    finish_reason: Literal["stop"] | None = None  # EOS / stop token: no decode needed
    queue_s: float  # arrival -> start of compute
    compute_s: float  # start of compute -> first token
    cached_tokens: int = 0  # prompt tokens whose KV was reused (local pool + store)
    cached_from_store: int = 0  # of those, loaded from the KV store


class Committed(_Wire):
    event: Literal["committed"] = "committed"
    exposed_transfer_s: float  # first token -> last layer committed (not hidden by compute)


class TokenEvent(_Wire):
    event: Literal["token"] = "token"
    token: WireToken
    finish_reason: Literal["stop", "length", "abort"] | None = None


class WaitingEvent(_Wire):
    """Decode: no token for a while, but the request is queued or preempted on an engine
    that is making progress (``steps``: its step count, grown since the last event).
    The gateway tells such a stream from a hung instance by it."""

    event: Literal["waiting"] = "waiting"
    steps: int


class MigrateEvent(_Wire):
    """Decode is draining: the stream ends here and continues on another instance,
    which loads the first ``tokens`` of KV from ``kv_ids`` (the watermark)."""

    event: Literal["migrate"] = "migrate"
    tokens: int
    kv_ids: list[str]


class ErrorEvent(_Wire):
    event: Literal["error"] = "error"
    code: str
    message: str


Event = Annotated[
    Accepted | FirstTokenEvent | Committed | TokenEvent | WaitingEvent | MigrateEvent | ErrorEvent,
    Field(discriminator="event"),
]
EVENTS: TypeAdapter[Event] = TypeAdapter(Event)


def encode_event(event: BaseModel) -> bytes:
    return event.model_dump_json(exclude_none=True).encode() + b"\n"


def decode_event(line: bytes | str) -> Event:
    return EVENTS.validate_json(line)
