"""Settings of the gateway (``BATON_GATEWAY_*``; model and cluster from ``BATON_*``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.cluster.membership import default_advertise_host


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_GATEWAY_", extra="ignore")

    # disaggregated: prefill + decode instances; colocated: whole requests to one engine
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)
    # where other gateways reach this one (recorded with each resumable response it
    # produces, so a follower can tell at once that it is gone)
    advertise_host: str = Field(default_factory=default_advertise_host)
    # comma-separated; empty = no authentication
    api_keys: Annotated[tuple[str, ...], NoDecode] = ()
    max_request_bytes: int = Field(default=1 << 20, ge=1024)
    max_prompt_tokens: int | None = Field(default=None, ge=1)  # None: the model's context
    # the most tokens one choice may generate (None: up to the context); a request
    # asking for more is refused, one asking for none gets this many at most
    max_output_tokens: int | None = Field(default=None, ge=1)
    max_in_flight: int = Field(default=256, ge=1)  # over this: 429 with Retry-After
    max_pending_prompt_tokens: int = Field(default=65536, ge=1)  # per prefill instance
    refresh_s: float = Field(default=0.5, gt=0)  # membership poll (half a heartbeat)
    worker_timeout_s: float = Field(default=600.0, gt=0)
    connect_attempts: int = Field(default=3, ge=1)  # instances tried per role and request
    # cache-aware routing competes only among prefill instances whose queued work is
    # within this many tokens of the least loaded one (a hot prefix cannot pile up)
    balance_tokens: float = Field(default=4096.0, ge=0)
    # a decode instance that streams nothing for this long while still registered is
    # treated as hung and its requests resumed elsewhere
    decode_progress_timeout_s: float = Field(default=60.0, gt=0)
    # ... and one silent this long (no token, no keepalive; every 0.25 s while the engine
    # steps or the stream's KV loads) as hung (at least 3 of the instance's recent
    # steps, and twice the TPOT target where one is set: paced steps are that far apart)
    decode_silence_s: float = Field(default=0.75, gt=0)
    # a request whose decode failed waits this long for an instance to take it over
    failover_timeout_s: float = Field(default=60.0, gt=0)
    # how often the prompt index entries of instances no longer live are cleared
    reap_s: float = Field(default=10.0, gt=0)
    # mixed pool (baton up --mixed): a mixed instance whose own queue is empty takes the
    # other role's work while every instance of that role has more than this many prompt
    # tokens queued (prefill) or runs this many streams or waits for KV space (decode)
    lend_prefill_tokens: float = Field(default=512.0, ge=0)
    lend_decode_running: float = Field(default=32.0, ge=1)
    # ... and a decode instance only while its recent steps take less than this (its
    # streams' time per output token, with the prompt chunks it took); 0: no limit
    lend_decode_step_s: float = Field(default=0.075, ge=0)
    # resumable responses (Responses API, stream_options.resumable): their event logs in
    # Redis are kept this long after the last event, at most this many events each, and
    # the gateway producing one renews its lease this often (a third of it); another
    # gateway continues a response whose lease has lapsed
    response_retention_s: float = Field(default=600.0, gt=0)
    response_max_events: int = Field(default=100_000, ge=16)
    response_lease_s: float = Field(default=3.0, gt=0)
    # scope every request's cache_salt to its API key: tenants never share KV blocks
    cache_salt_by_api_key: bool = False

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(k.strip() for k in value.split(",") if k.strip())
        return value
