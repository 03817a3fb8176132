"""``python -m services.prefill``: run one prefill instance (settings from ``BATON_*``)."""

from __future__ import annotations

from fastapi import FastAPI

from services.prefill.app import create_app
from services.prefill.settings import PrefillSettings
from shared.config import BatonSettings
from shared.service import run_service


def build() -> tuple[FastAPI, str, int]:
    settings = PrefillSettings()
    return create_app(settings, BatonSettings()), settings.host, settings.port


if __name__ == "__main__":
    run_service("prefill", build, (PrefillSettings, BatonSettings))
