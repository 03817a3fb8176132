"""Settings of a mixed-pool instance (``BATON_MIXED_*``; the engine's come from ``BATON_*``).

It takes every prefill and decode setting (``BATON_MIXED_PUT_TTL_S``,
``BATON_MIXED_REPLICATE``, ...) under its own prefix."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.decode.settings import DecodeRoleSettings
from services.prefill.settings import PrefillSettings


class MixedSettings(PrefillSettings, DecodeRoleSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_MIXED_", extra="ignore")

    port: int = Field(default=8500, ge=0, le=65535)
    # the role it registers as and serves first; the gateway lends it to the other role
    # while its own queue is empty and the other role's is over its bound
    home: Literal["prefill", "decode"] = "decode"
