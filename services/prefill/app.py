"""The prefill instance's HTTP API: ``POST /v1/prefill`` (an NDJSON event stream)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from services.prefill.prefiller import Prefiller
from services.prefill.settings import PrefillSettings
from shared.config import BatonSettings
from shared.serving.protocol import PrefillRequest
from shared.serving.worker_app import bind_request_id, create_worker_app, stream_events


def prefill_routes(app: FastAPI, prefiller: Prefiller) -> None:
    @app.post("/v1/prefill")
    async def prefill(body: PrefillRequest, request: Request) -> Response:
        bind_request_id(request)
        return await stream_events(prefiller.run(body))


def create_app(settings: PrefillSettings, baton: BatonSettings) -> FastAPI:
    return create_worker_app(Prefiller(settings, baton), "Baton prefill", prefill_routes)
