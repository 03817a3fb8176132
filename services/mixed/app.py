"""The mixed instance's HTTP API: the prefill instance's and the decode instance's."""

from __future__ import annotations

from fastapi import FastAPI

from services.decode.app import decode_routes
from services.mixed.settings import MixedSettings
from services.mixed.worker import Mixed
from services.prefill.app import prefill_routes
from shared.config import BatonSettings
from shared.serving.worker_app import create_worker_app


def _routes(app: FastAPI, worker: Mixed) -> None:
    prefill_routes(app, worker)
    decode_routes(app, worker)


def create_app(settings: MixedSettings, baton: BatonSettings) -> FastAPI:
    return create_worker_app(Mixed(settings, baton), f"Baton mixed ({settings.home})", _routes)
