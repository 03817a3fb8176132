"""``python -m services.decode``: run one decode instance (settings from ``BATON_*``)."""

from __future__ import annotations

from fastapi import FastAPI

from services.decode.app import create_app
from services.decode.settings import DecodeSettings
from shared.config import BatonSettings
from shared.service import run_service


def build() -> tuple[FastAPI, str, int]:
    settings = DecodeSettings()
    return create_app(settings, BatonSettings()), settings.host, settings.port


if __name__ == "__main__":
    run_service("decode", build, (DecodeSettings, BatonSettings))
