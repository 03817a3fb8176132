"""The gateway's HTTP API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``, ``/ready``, ``/metrics``.

Edge rules: optional API keys (``Authorization: Bearer``), a request size
limit (413), bodies validated with pydantic (400 with an OpenAI error body,
invalid JSON included), unknown model 404, prompt over the context 400,
backpressure 429 with ``Retry-After``, no live instance of a role 503. The
request id (the client's ``X-Request-Id`` or a new one) goes to every worker
and into every log line, and comes back in the response header.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from services.gateway.decode_session import FailoverPolicy
from services.gateway.handoff import CacheReport, Generated, Handoff
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_types import ChatCompletionRequest, CompletionRequest
from services.gateway.prefix_locator import PrefixLocator
from services.gateway.responses import SSE_DONE, Kind, Prepared, ResponseBuilder, Step, sse
from services.gateway.router import Router
from services.gateway.settings import GatewaySettings
from shared.cluster.block_index import BlockIndex
from shared.cluster.keys import Keys
from shared.cluster.watermarks import Watermarks
from shared.config import BatonSettings
from shared.errors import InvalidRequestError
from shared.logs import request_id_var
from shared.model.loader import TokenizerOnly, load_tokenizer
from shared.service import component_of, service_app
from shared.serving.errors import ServiceError, classify, error_body, error_response
from shared.serving.protocol import REQUEST_ID_HEADER, SamplingSpec

log = logging.getLogger(__name__)


class Gateway:
    """Long-lived parts, created once in the lifespan."""

    def __init__(self, settings: GatewaySettings, baton: BatonSettings, model: TokenizerOnly):
        self.settings = settings
        self.model = model
        cluster = baton.cluster_config()
        self.redis = aioredis.from_url(
            cluster.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0
        )
        keys = Keys(cluster.redis_prefix)
        index = BlockIndex(self.redis, keys, cluster.index_ttl_s)
        self.router = Router(
            self.redis,
            keys,
            model=model.name,
            refresh_s=settings.refresh_s,
            balance_tokens=settings.balance_tokens,
            index=index,
            reap_s=settings.reap_s,
        )
        self.locator = PrefixLocator(index, enabled=baton.enable_prefix_caching)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.worker_timeout_s, connect=2.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self.metrics = GatewayMetrics()
        self.handoff = Handoff(
            self.http,
            self.router,
            self.locator,
            Watermarks(self.redis, keys),
            self.metrics,
            attempts=settings.connect_attempts,
            failover=FailoverPolicy(
                progress_timeout_s=settings.decode_progress_timeout_s,
                failover_timeout_s=settings.failover_timeout_s,
            ),
            colocated=settings.mode == "colocated",
        )
        self.roles = ("colocated",) if settings.mode == "colocated" else ("prefill", "decode")
        self.in_flight = 0

    async def start(self) -> None:
        await self.router.start()

    async def stop(self) -> None:
        await self.router.stop()
        await self.handoff.background.drain()
        await self.http.aclose()
        await self.redis.aclose()

    # -- edge checks -------------------------------------------------------------------
    def check_auth(self, request: Request) -> str | None:
        """The caller's API key (None when the gateway requires none)."""
        keys = self.settings.api_keys
        if not keys:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not any(secrets.compare_digest(token, k) for k in keys):
            raise ServiceError(401, "missing or invalid API key", code="invalid_api_key")
        return token

    def cache_salt(self, requested: str | None, api_key: str | None) -> str | None:
        """The request's ``cache_salt``, scoped to its API key when the gateway salts by
        key: requests of different keys (or salts) never share a KV block."""
        if not self.settings.cache_salt_by_api_key or api_key is None:
            return requested
        return tenant_salt(api_key, requested)

    async def read_body(self, request: Request) -> bytes:
        limit = self.settings.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ServiceError(413, f"request body over {limit} bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ServiceError(
                    413, f"request body over {limit} bytes", code="request_too_large"
                )
        return bytes(body)

    def prepare(
        self, kind: Kind, raw: bytes, request_id: str, api_key: str | None = None
    ) -> tuple[Prepared, SamplingSpec]:
        model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            body = model_cls.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            message = first["msg"] if first["type"] != "json_invalid" else "invalid JSON body"
            raise ServiceError(400, message, code="invalid_request", param=param) from exc
        if body.model != self.model.name:
            raise ServiceError(
                404, f"the model {body.model!r} does not exist", code="model_not_found",
                param="model",
            )  # fmt: skip
        tok = self.model.tokenizer
        if isinstance(body, ChatCompletionRequest):
            prompt = tok.encode_chat(body.message_dicts())
        elif isinstance(body.prompt, str):
            prompt = tok.encode(body.prompt)
        else:
            prompt = [int(t) for t in body.prompt]  # token ids
            vocab = self.model.arch.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        context = self.model.arch.max_position_embeddings
        limit = min(context, self.settings.max_prompt_tokens or context)
        if len(prompt) >= limit:
            raise ServiceError(
                400,
                f"the prompt has {len(prompt)} tokens; this model accepts at most {limit - 1}",
                code="context_length_exceeded",
                param="messages" if kind == "chat" else "prompt",
            )
        max_tokens = body.limit() or context - len(prompt)
        if len(prompt) + max_tokens > context:
            raise ServiceError(
                400,
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context length {context}",
                code="context_length_exceeded",
                param="max_tokens",
            )
        spec = SamplingSpec(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed if body.seed is not None else secrets.randbits(63),
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logprobs=body.num_logprobs(),
        )
        prepared = Prepared(
            kind=kind,
            request_id=request_id,
            model=self.model.name,
            prompt=prompt,
            max_tokens=max_tokens,
            stop=body.stop_list(),
            num_logprobs=body.num_logprobs(),
            include_usage=body.include_usage(),
            return_token_ids=body.return_token_ids,
            stream=body.stream,
            cache_salt=self.cache_salt(body.cache_salt, api_key),
        )
        return prepared, spec

    def admit(self, prepared: Prepared) -> None:
        retry = {"Retry-After": "1"}
        if self.in_flight >= self.settings.max_in_flight:
            raise ServiceError(
                429, "too many requests in flight; retry later", code="overloaded", headers=retry
            )
        for role in self.roles:
            if not self.router.live(role):
                raise ServiceError(
                    503, f"no live {role} instance is available", code="no_live_instance"
                )
        first_role = self.roles[0]
        pending = [self.router.score(m, first_role) for m in self.router.live(first_role)]
        if min(pending) + len(prepared.prompt) > self.settings.max_pending_prompt_tokens:
            raise ServiceError(
                429, "prefill queues are full; retry later", code="overloaded", headers=retry
            )

    def refresh_gauges(self) -> None:
        self.metrics.in_flight.set(self.in_flight)
        for role, depth in self.router.queue_depths().items():
            self.metrics.queue.labels(role).set(depth)
            self.metrics.live.labels(role).set(len(self.router.live(role)))


def tenant_salt(api_key: str, requested: str | None) -> str:
    """A salt unique to an API key (and the request's own salt, if any); the key itself
    never leaves the gateway."""
    tenant = hashlib.sha256(api_key.encode()).hexdigest()[:32]
    return f"key:{tenant}" if requested is None else f"key:{tenant}|{requested}"


class Timeline:
    """Per-request latency bookkeeping (vLLM's serving-benchmark definitions)."""

    def __init__(self, metrics: GatewayMetrics):
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.cache: CacheReport | None = None

    def token(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        elif self.last is not None:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.tokens += 1

    def end(self, outcome: str) -> None:
        cache = self.cache
        log.info(
            "request %s: %d tokens, ttft %s, e2e %.3fs, cached tokens %s (router predicted %s)",
            outcome,
            self.tokens,
            f"{self.first - self.start:.3f}s" if self.first is not None else "-",
            time.perf_counter() - self.start,
            cache.actual if cache is not None else "-",
            cache.predicted if cache is not None else "-",
        )
        self.metrics.requests.labels(outcome).inc()
        self.metrics.output_tokens.inc(self.tokens)
        if outcome != "ok" or self.first is None or self.last is None:
            return
        self.metrics.e2e.observe(self.last - self.start)
        if self.tokens > 1:
            self.metrics.tpot.observe((self.last - self.first) / (self.tokens - 1))


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def serve(gw: Gateway, kind: Kind, request: Request) -> Response:
    request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
    request_id_var.set(request_id)
    headers = {REQUEST_ID_HEADER: request_id}
    try:
        api_key = gw.check_auth(request)
        prepared, spec = gw.prepare(kind, await gw.read_body(request), request_id, api_key)
        gw.admit(prepared)
    except Exception as exc:
        gw.metrics.requests.labels("rejected").inc()
        response = error_response(exc)
        response.headers.update(headers)
        return response
    gw.in_flight += 1
    gw.metrics.prompt_tokens.inc(len(prepared.prompt))
    timeline = Timeline(gw.metrics)
    tokens = gw.handoff.generate(request_id, prepared.prompt, spec, prepared.cache_salt)
    builder = ResponseBuilder(prepared, gw.model.tokenizer)
    # Wait for the first token before answering, so that a failure before it (no
    # instance, refused prompt) is a proper HTTP status; stop if the client leaves.
    first_task = asyncio.ensure_future(anext(tokens))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({first_task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not first_task.done():
        first_task.cancel()
        with contextlib.suppress(BaseException):
            await first_task
        await tokens.aclose()
        gw.in_flight -= 1
        timeline.end("client_gone")
        return Response(status_code=499, headers=headers)
    try:
        first = first_task.result()
    except Exception as exc:
        await tokens.aclose()
        gw.in_flight -= 1
        timeline.end("error")
        response = error_response(exc)
        response.headers.update(headers)
        return response
    timeline.token()
    if first.cache is not None:
        builder.cached_tokens = first.cache.actual
        gw.metrics.observe_cache(first.cache.predicted, first.cache.actual)
        timeline.cache = first.cache
    if prepared.stream:
        body = _stream(gw, builder, first, tokens, timeline)
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)
    return await _whole(gw, builder, first, tokens, timeline, headers)


async def _steps(
    builder: ResponseBuilder,
    first: Generated,
    tokens: AsyncIterator[Generated],
    timeline: Timeline,
) -> AsyncIterator[Step]:
    step = builder.add(first)
    yield step
    while step.finish_reason is None:
        gen = await anext(tokens)
        timeline.token()
        step = builder.add(gen)
        yield step


async def _stream(
    gw: Gateway,
    builder: ResponseBuilder,
    first: Generated,
    tokens: Any,
    timeline: Timeline,
) -> AsyncIterator[str]:
    outcome = "client_gone"
    try:
        try:
            async for step in _steps(builder, first, tokens, timeline):
                yield builder.chunk(step)
            yield builder.final_chunk()
            if builder.p.include_usage:
                yield builder.usage_chunk()
            outcome = "ok"
        except (Exception, StopAsyncIteration) as exc:
            err = classify(exc if isinstance(exc, Exception) else RuntimeError("stream ended"))
            log.warning("stream failed: %s", err)
            outcome = "error"
            yield sse(error_body(err.status, str(err), err.code))
        yield SSE_DONE
    finally:
        await tokens.aclose()
        gw.in_flight -= 1
        timeline.end(outcome)


async def _whole(
    gw: Gateway,
    builder: ResponseBuilder,
    first: Generated,
    tokens: Any,
    timeline: Timeline,
    headers: dict[str, str],
) -> Response:
    outcome = "error"
    try:
        steps = [s async for s in _steps(builder, first, tokens, timeline)]
        outcome = "ok"
        return JSONResponse(builder.response(steps), headers=headers)
    except Exception as exc:
        response = error_response(exc)
        response.headers.update(headers)
        return response
    finally:
        await tokens.aclose()
        gw.in_flight -= 1
        timeline.end(outcome)


def create_app(settings: GatewaySettings, baton: BatonSettings) -> FastAPI:
    async def build() -> Gateway:
        model = await asyncio.to_thread(load_tokenizer, baton.model, cache_dir=baton.cache_dir)
        log.info("gateway serving %s on port %d", model.name, settings.port)
        return Gateway(settings, baton, model)

    app = service_app("Baton gateway", build)

    def gateway(request: Request) -> Gateway:
        return component_of(request, Gateway)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(gateway(request), "chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(gateway(request), "completion", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        gw = gateway(request)
        try:
            gw.check_auth(request)
        except ServiceError as exc:
            return error_response(exc)
        created = int(min((m.started_at for m in gw.router.live("decode")), default=time.time()))
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": gw.model.name,
                        "object": "model",
                        "created": created,
                        "owned_by": "baton",
                        "max_model_len": gw.model.arch.max_position_embeddings,
                    }
                ],
            }
        )

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        gw = gateway(request)
        live = {role: len(gw.router.live(role)) for role in gw.roles}
        up = all(live.values())
        body = {"status": "ready" if up else "waiting", "redis": gw.router.redis_ok, **live}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        gw = gateway(request)
        return Response(gw.metrics.render(gw.refresh_gauges), media_type="text/plain")

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            error_body(404, f"no route {request.method} {request.url.path}", "not_found"), 404
        )

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            error_body(405, f"{request.method} is not allowed on {request.url.path}"), 405
        )

    return app
