"""Settings of a prefill instance (``BATON_PREFILL_*``; the engine's come from ``BATON_*``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.kvstore.pull_cost import PullPolicy
from shared.serving.worker import WorkerSettings


class PrefillSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_PREFILL_", extra="ignore")

    port: int = Field(default=8100, ge=0, le=65535)
    put_ttl_s: float = Field(default=300.0, gt=0)  # store reservation: covers queueing here
    # prompts shorter than this send whole blocks once, after the last layer (Splitwise
    # does both: per-layer messages cost more than they hide for short prompts)
    layerwise_min_tokens: int = Field(default=0, ge=0)
    # pull a cached prefix from the store when the cost model says it is cheaper than
    # recomputing it (auto), always, or never (recompute; for measuring the crossover)
    pull_policy: PullPolicy = "auto"
