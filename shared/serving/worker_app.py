"""The HTTP side every worker shares: its FastAPI app (/health /ready /stats /metrics
and the role's routes), the request-id binding, and NDJSON streaming responses."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from shared.cluster.auth import AuthMetrics, ClusterSecret, protect
from shared.logs import request_id_var
from shared.service import service_app
from shared.serving.errors import classify, error_response
from shared.serving.protocol import REQUEST_ID_HEADER, ErrorEvent, encode_event
from shared.serving.worker import Worker


def bind_request_id(request: Request) -> str | None:
    """Log lines of this request's task carry the gateway's request id."""
    rid = request.headers.get(REQUEST_ID_HEADER)
    request_id_var.set(rid)
    return rid


async def stream_events(events: AsyncGenerator[BaseModel, None]) -> Response:
    """An NDJSON response of ``events``. An error before the first event is a plain HTTP
    error (status + body); later errors end the stream with an ``error`` event. Closing
    the response early (the gateway went away) closes ``events``, whose cleanup runs."""
    try:
        first = await anext(events)
    except Exception as exc:
        return error_response(exc)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield encode_event(first)
            async for event in events:
                yield encode_event(event)
        except Exception as exc:
            err = classify(exc)
            yield encode_event(ErrorEvent(code=err.code or "error", message=str(err)))
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="application/x-ndjson")


W = TypeVar("W", bound=Worker)


def create_worker_app(worker: W, title: str, routes: Callable[[FastAPI, W], None]) -> FastAPI:
    """The FastAPI app of a worker: /health /ready /stats /metrics, then ``routes``."""

    async def build() -> W:
        return worker

    app = service_app(title, build)
    secret = ClusterSecret(worker.cluster.secret)
    secret.warn_if_open(title)
    protect(app, secret, AuthMetrics(worker.metrics.registry))

    @app.get("/ready")
    async def ready() -> JSONResponse:
        up = worker.serving
        redis_ok = worker.heartbeat is not None and worker.heartbeat.healthy
        status = "ready" if up and redis_ok else ("degraded" if up else "starting")
        if worker.draining:
            status = "draining"
        body = {"status": status, "redis": redis_ok, "instance_id": worker.instance_id}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/stats")
    async def stats() -> dict[str, float]:
        return worker.stats()

    @app.get("/metrics")
    async def metrics() -> Response:
        body = worker.metrics.render(worker.refresh_gauges)
        return Response(body, media_type="text/plain; version=0.0.4")

    routes(app, worker)
    return app
