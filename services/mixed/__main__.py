"""``python -m services.mixed``: run one mixed-pool instance (settings from ``BATON_*``)."""

from __future__ import annotations

from fastapi import FastAPI

from services.mixed.app import create_app
from services.mixed.settings import MixedSettings
from shared.config import BatonSettings
from shared.service import run_service


def build() -> tuple[FastAPI, str, int]:
    settings = MixedSettings()
    return create_app(settings, BatonSettings()), settings.host, settings.port


if __name__ == "__main__":
    run_service("mixed", build, (MixedSettings, BatonSettings))
