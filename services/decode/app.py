"""The decode instance's HTTP API: ``POST /v1/decode`` (NDJSON token stream) and
``POST /v1/decode/{request_id}/first_token``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services.decode.colocated import Colocated
from services.decode.decoder import Decoder
from services.decode.settings import DecodeSettings
from shared.config import BatonSettings
from shared.serving.errors import error_response
from shared.serving.protocol import DecodeRequest, FirstToken, PrefillRequest
from shared.serving.worker_app import bind_request_id, create_worker_app, stream_events


def decode_routes(app: FastAPI, decoder: Decoder) -> None:
    @app.post("/v1/decode")
    async def decode(body: DecodeRequest, request: Request) -> Response:
        bind_request_id(request)
        return await stream_events(decoder.run(body))

    @app.post("/v1/decode/{request_id}/first_token")
    async def first_token(request_id: str, body: FirstToken, request: Request) -> Response:
        bind_request_id(request)
        try:
            decoder.deliver_first_token(request_id, body.token)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"status": "ok"})


def _colocated_routes(app: FastAPI, worker: Colocated) -> None:
    @app.post("/v1/generate")
    async def generate(body: PrefillRequest, request: Request) -> Response:
        bind_request_id(request)
        return await stream_events(worker.run(body))


def create_app(settings: DecodeSettings, baton: BatonSettings) -> FastAPI:
    if settings.colocated:
        return create_worker_app(Colocated(settings, baton), "Baton colocated", _colocated_routes)
    return create_worker_app(Decoder(settings, baton), "Baton decode", decode_routes)
