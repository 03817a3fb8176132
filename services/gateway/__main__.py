"""``python -m services.gateway``: run the gateway (settings from ``BATON_*``)."""

from __future__ import annotations

from fastapi import FastAPI

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from shared.config import BatonSettings
from shared.service import run_service


def build() -> tuple[FastAPI, str, int]:
    settings = GatewaySettings()
    return create_app(settings, BatonSettings()), settings.host, settings.port


if __name__ == "__main__":
    run_service("gateway", build, (GatewaySettings, BatonSettings))
