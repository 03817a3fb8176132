"""The gateway's HTTP API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/v1/models/{id}``, ``/health``, ``/ready``, ``/metrics``, ``/openapi.json``, and the
operators' status page ``/status`` (its data: ``/status.json``).

The routes only: the edge checks and the long-lived parts are
:mod:`services.gateway.gateway`, serving a validated request
:mod:`services.gateway.completion`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from redis.exceptions import RedisError

from services.gateway import response_service
from services.gateway.completion import serve
from services.gateway.gateway import Gateway, model_not_found
from services.gateway.openai_schema import (
    RESPONSES_NOTE,
    RESUMABLE_NOTE,
    ChatCompletion,
    Completion,
    DeletedResponse,
    Model,
    ModelList,
    Readiness,
    ResponseObject,
    ok_response,
    request_body,
    request_schemas,
    with_links,
)
from services.gateway.openai_types import ChatCompletionRequest, CompletionRequest
from services.gateway.reattach import reattach, rebuild_run
from services.gateway.response_service import rebuild_response
from services.gateway.responses_api import ResponsesRequest
from services.gateway.settings import GatewaySettings
from services.gateway.status_page import PAGE, snapshot
from shared.config import BatonSettings
from shared.model.tokenizer_loader import load_tokenizer
from shared.service import component_of, service_app
from shared.serving.errors import ServiceError, error_body, error_response

log = logging.getLogger(__name__)


def create_app(settings: GatewaySettings, baton: BatonSettings) -> FastAPI:
    async def build() -> Gateway:
        model = await asyncio.to_thread(load_tokenizer, baton.model, cache_dir=baton.cache_dir)
        log.info("gateway serving %s on port %d", model.name, settings.port)
        gw = Gateway(settings, baton, model)
        # what continues each kind of resumable response another gateway started
        gw.resumables.rebuild.update(
            chat=partial(rebuild_run, gw),
            completion=partial(rebuild_run, gw),
            response=partial(rebuild_response, gw),
        )
        return gw

    app = service_app("Baton gateway", build)

    def gateway(request: Request) -> Gateway:
        return component_of(request, Gateway)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=request_body(ChatCompletionRequest),
        responses=ok_response(ChatCompletion, streams=True),
    )
    async def chat(request: Request) -> Response:
        return await serve(gateway(request), "chat", request)

    @app.post(
        "/v1/completions",
        openapi_extra=request_body(CompletionRequest),
        responses=ok_response(Completion, streams=True),
    )
    async def completions(request: Request) -> Response:
        return await serve(gateway(request), "completion", request)

    @app.get(
        "/v1/chat/completions/{response_id}/stream",
        responses=ok_response(ChatCompletion, streams=True, note=RESUMABLE_NOTE),
    )
    async def chat_reattach(response_id: str, request: Request) -> Response:
        """Reattach to a resumable chat stream: the events after ``Last-Event-ID`` (or
        ``starting_after``)."""
        return await reattach(gateway(request), ("chat",), response_id, request)

    @app.get(
        "/v1/completions/{response_id}/stream",
        responses=ok_response(Completion, streams=True, note=RESUMABLE_NOTE),
    )
    async def completion_reattach(response_id: str, request: Request) -> Response:
        return await reattach(gateway(request), ("completion",), response_id, request)

    @app.post(
        "/v1/responses",
        operation_id="createResponse",
        openapi_extra=request_body(ResponsesRequest),
        responses=with_links(
            ok_response(ResponseObject, streams=True, note=RESPONSES_NOTE),
            {
                "retrieve": "retrieveResponse",
                "cancel": "cancelResponse",
                "delete": "deleteResponse",
            },
        ),
    )
    async def responses_create(request: Request) -> Response:
        return await response_service.create(gateway(request), request)

    @app.get(
        "/v1/responses/{response_id}",
        operation_id="retrieveResponse",
        responses=ok_response(ResponseObject, streams=True, note=RESPONSES_NOTE),
    )
    async def responses_retrieve(response_id: str, request: Request) -> Response:
        return await response_service.retrieve(gateway(request), response_id, request)

    @app.post(
        "/v1/responses/{response_id}/cancel",
        operation_id="cancelResponse",
        responses=ok_response(ResponseObject, streams=False),
    )
    async def responses_cancel(response_id: str, request: Request) -> Response:
        return await response_service.cancel(gateway(request), response_id, request)

    @app.delete(
        "/v1/responses/{response_id}",
        operation_id="deleteResponse",
        responses=ok_response(DeletedResponse, streams=False),
    )
    async def responses_delete(response_id: str, request: Request) -> Response:
        return await response_service.delete(gateway(request), response_id, request)

    @app.get("/v1/models", responses=ok_response(ModelList, streams=False))
    async def models(request: Request) -> Response:
        gw = gateway(request)
        try:
            gw.check_auth(request)
        except ServiceError as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": [gw.model_card()]})

    @app.get("/v1/models/{model_id:path}", responses=ok_response(Model, streams=False))
    async def model(model_id: str, request: Request) -> Response:
        gw = gateway(request)
        try:
            gw.check_auth(request)
            if model_id != gw.model.name:
                raise model_not_found(model_id)
        except ServiceError as exc:
            return error_response(exc)
        return JSONResponse(gw.model_card())

    @app.get(
        "/ready",
        responses={
            200: {"model": Readiness, "description": "Every role has a live instance"},
            503: {"model": Readiness, "description": "Some role has no live instance"},
        },
    )
    async def ready(request: Request) -> JSONResponse:
        gw = gateway(request)
        live = {role: len(gw.router.live(role)) for role in gw.roles}
        up = all(gw.router.candidates(role) for role in gw.roles)  # mixed ones may stand in
        body = {
            "status": "ready" if up else "waiting",
            "redis": gw.router.redis_ok,
            "gateway": gw.instance_id,
            **live,
        }
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics(request: Request) -> Response:
        gw = gateway(request)
        return Response(gw.metrics.render(gw.refresh_gauges), media_type="text/plain")

    @app.get("/status", include_in_schema=False, response_class=HTMLResponse)
    async def status_page() -> HTMLResponse:
        return HTMLResponse(PAGE)

    @app.get("/status.json", include_in_schema=False)
    async def status_data(request: Request) -> JSONResponse:
        gw = gateway(request)
        try:
            body = await snapshot(gw.redis, gw.keys, gw.metrics.recent, gw.model.name)
            body["slo"] = asdict(gw.metrics.slo_window.attainment())
        except RedisError as exc:
            return error_response(
                ServiceError(503, f"Redis is unreachable: {exc}", code="redis_unavailable")
            )
        return JSONResponse(body)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(request_schemas())
            gw = getattr(app.state, "component", None)
            if isinstance(gw, Gateway):
                gw.narrow_schemas(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            error_body(404, f"no route {request.method} {request.url.path}", "not_found"), 404
        )

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Exception) -> JSONResponse:
        # every route on this path (Starlette names only the first one's methods)
        methods: set[str] = set()
        for route in app.routes:
            if isinstance(route, APIRoute) and route.path_regex.match(request.url.path):
                methods |= route.methods or set()
        return JSONResponse(
            error_body(405, f"{request.method} is not allowed on {request.url.path}"),
            405,
            headers={"Allow": ", ".join(sorted(methods))} if methods else {},
        )

    return app
