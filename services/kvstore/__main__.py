"""``python -m services.kvstore``: run one KV store node (settings from ``BATON_*``)."""

from __future__ import annotations

from fastapi import FastAPI

from services.kvstore.app import create_app
from services.kvstore.settings import KVStoreSettings
from shared.config import BatonSettings
from shared.service import run_service


def build() -> tuple[FastAPI, str, int]:
    settings = KVStoreSettings()
    return create_app(settings, BatonSettings().cluster_config()), settings.host, settings.http_port


if __name__ == "__main__":
    run_service("kvstore", build, (KVStoreSettings, BatonSettings))
