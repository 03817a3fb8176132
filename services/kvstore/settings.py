"""Environment-facing settings of a KV store node (prefix ``BATON_KVSTORE_``)."""

from __future__ import annotations

import uuid

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.kvstore.store import StoreConfig
from shared.cluster.membership import default_advertise_host


class KVStoreSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_KVSTORE_", extra="ignore")

    host: str = "0.0.0.0"
    advertise_host: str = Field(default_factory=default_advertise_host)
    http_port: int = Field(default=8300, ge=0, le=65535)
    data_port: int = Field(default=8301, ge=0, le=65535)
    # the arena: reserved at start, its pages taken as blocks arrive, so a busy store
    # grows to this; 1 GiB caches ~23,000 tokens of the default model in fp32
    capacity_gb: float = Field(default=1.0, gt=0)
    slab_mb: int = Field(default=32, ge=1)
    high_watermark: float = Field(default=0.95, gt=0, le=1)
    low_watermark: float = Field(default=0.85, gt=0, le=1)
    sweep_s: float = Field(default=0.5, gt=0)
    # the arena lives in /dev/shm so clients on this host copy blocks straight to and
    # from it (only control messages on the socket); off: private memory, sockets only
    shm: bool = True
    instance_id: str = Field(default_factory=lambda: f"kvstore-{uuid.uuid4().hex[:8]}")

    @model_validator(mode="after")
    def _watermarks(self) -> KVStoreSettings:
        if self.low_watermark > self.high_watermark:
            raise ValueError("low_watermark must not exceed high_watermark")
        if self.capacity_gb * 1024 < self.slab_mb:
            raise ValueError("capacity must hold at least one slab")
        return self

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            capacity_bytes=int(self.capacity_gb * (1 << 30)),
            slab_bytes=self.slab_mb << 20,
            high_watermark=self.high_watermark,
            low_watermark=self.low_watermark,
            shared=self.shm,
        )
