"""Settings of a decode instance (``BATON_DECODE_*``; the engine's come from ``BATON_*``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.serving.worker import WorkerSettings


class DecodeRoleSettings(WorkerSettings):
    """What serving the decode role takes (a decode instance's, and a mixed one's)."""

    first_token_timeout_s: float = Field(default=300.0, gt=0)
    # write every block a request completes to the KV store, with a watermark in Redis,
    # so a stream resumes elsewhere without recomputing (off: failover recomputes)
    replicate: bool = True


class DecodeSettings(DecodeRoleSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_DECODE_", extra="ignore")

    port: int = Field(default=8200, ge=0, le=65535)
    colocated: bool = False  # serve whole requests (both phases): the colocated baseline
