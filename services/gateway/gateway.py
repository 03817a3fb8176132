"""The gateway's long-lived parts (:class:`Gateway`, created once in the lifespan) and
its edge checks: API keys, the request size limit (413), bodies validated with pydantic
(400 naming the parameter), unknown model 404, prompt over the context 400,
backpressure 429 with ``Retry-After``, no live instance of a role 503. The routes
are :mod:`services.gateway.app`; serving a validated request is
:mod:`services.gateway.completion`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
import uuid
from typing import Any, TypeVar

import httpx
from fastapi import Request
from pydantic import ValidationError
from redis.exceptions import RedisError

from services.gateway.decode_session import FailoverPolicy
from services.gateway.handoff import Handoff
from services.gateway.lending import LendPolicy
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_types import ChatCompletionRequest, CompletionRequest
from services.gateway.prefix_locator import PrefixLocator
from services.gateway.responses import Kind, Prepared
from services.gateway.responses_api import ResponsesRequest
from services.gateway.resumable import Resumables
from services.gateway.router import Router
from services.gateway.settings import GatewaySettings
from shared.cluster import redis_client
from shared.cluster.auth import ClusterSecret
from shared.cluster.block_index import BlockIndex
from shared.cluster.event_log import EventLog
from shared.cluster.in_flight import InFlightIndex
from shared.cluster.keys import Keys
from shared.cluster.slo import publish as publish_slo
from shared.cluster.watermarks import Watermarks
from shared.config import BatonSettings
from shared.engine.constraint import Constraint
from shared.engine.grammar import GrammarCompiler
from shared.errors import InvalidRequestError
from shared.model.tokenizer_loader import TokenizerOnly
from shared.serving.errors import ServiceError
from shared.serving.protocol import ConstraintSpec, SamplingSpec

log = logging.getLogger(__name__)
# a connection to another gateway (is it gone?) is refused at once by a killed one
OWNER_PROBE_TIMEOUT = httpx.Timeout(1.0, connect=0.25)
# a request body with a model name (chat, completions, Responses)
Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest, ResponsesRequest)


def _constraint_param(constraint: Constraint) -> str:
    """The request field an output constraint came from, for the error body."""
    if constraint.kind == "grammar" and "<tool_call>" in constraint.spec:
        return "tools"
    return (
        "response_format"
        if constraint.kind in ("json_schema", "json_object")
        else ("structured_outputs")
    )


class Gateway:
    """Long-lived parts, created once in the lifespan."""

    def __init__(self, settings: GatewaySettings, baton: BatonSettings, model: TokenizerOnly):
        self.settings = settings
        self.model = model
        cluster = baton.cluster_config()
        self.redis = redis_client.connect(cluster.redis_url)
        self.keys = keys = Keys(cluster.redis_prefix)
        index = BlockIndex(self.redis, keys, cluster.index_ttl_s)
        in_flight = InFlightIndex(self.redis, keys)
        self.router = Router(
            self.redis,
            keys,
            model=model.name,
            refresh_s=settings.refresh_s,
            balance_tokens=settings.balance_tokens,
            index=index,
            reap_s=settings.reap_s,
            lend=LendPolicy(
                settings.lend_prefill_tokens,
                settings.lend_decode_running,
                settings.lend_decode_step_s,
            ).for_slo(
                baton.slo(), step_bound_given="lend_decode_step_s" in settings.model_fields_set
            ),
            member_ttl_s=cluster.member_ttl_s,
            in_flight=in_flight if baton.enable_prefix_caching else None,
        )
        self.locator = PrefixLocator(
            index,
            enabled=baton.enable_prefix_caching,
            in_flight=in_flight,
        )
        self.http = httpx.AsyncClient(  # internal calls: they present the cluster secret
            headers=ClusterSecret(cluster.secret).headers(),
            timeout=httpx.Timeout(settings.worker_timeout_s, connect=2.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self.metrics = GatewayMetrics(model.name, model.arch.max_position_embeddings, baton.slo())
        self._slo_task: asyncio.Task[None] | None = None
        # the engine's own checks, run here so a bad schema costs no instance anything
        tok = model.tokenizer
        self.grammars = GrammarCompiler(tok.to_json(), model.arch.vocab_size, tok.eos_token_ids)
        self.handoff = Handoff(
            self.http,
            self.router,
            self.locator,
            Watermarks(self.redis, keys),
            self.metrics,
            attempts=settings.connect_attempts,
            failover=FailoverPolicy(
                progress_timeout_s=settings.decode_progress_timeout_s,
                silence_s=max(settings.decode_silence_s, 2 * (baton.slo().tpot_s or 0.0)),
                failover_timeout_s=settings.failover_timeout_s,
            ),
            colocated=settings.mode == "colocated",
        )
        self.roles = ("colocated",) if settings.mode == "colocated" else ("prefill", "decode")
        self.in_flight = 0
        self.instance_id = f"gateway-{uuid.uuid4().hex[:8]}"
        events = EventLog(
            self.redis,
            keys,
            retention_s=settings.response_retention_s,
            max_events=settings.response_max_events,
            lease_s=settings.response_lease_s,
        )
        # each kind's rebuild (a take-over) is registered by the app, which knows them
        self.resumables = Resumables(
            events,
            self.instance_id,
            rebuild={},
            owner_url=f"http://{settings.advertise_host}:{settings.port}" if settings.port else "",
            owner_gone=self._gateway_gone,
        )

    async def _gateway_gone(self, url: str, instance_id: str) -> bool:
        """Whether gateway ``instance_id`` at ``url`` is certainly gone: the port refuses
        connections (killed), or another gateway answers there (killed and restarted).
        One that answers as itself, or not within the timeout (stopped, starting, or
        unreachable for a while), may still hold its responses: their leases decide."""
        try:
            r = await self.http.get(url + "/ready", timeout=OWNER_PROBE_TIMEOUT)
            answering = r.json().get("gateway")
        except httpx.ConnectError:
            return True
        except (httpx.HTTPError, ValueError, AttributeError):
            return False
        return isinstance(answering, str) and answering != instance_id

    async def start(self) -> None:
        await self.router.start()
        if self.metrics.slo_window.targets.is_set:
            self._slo_task = asyncio.create_task(self._publish_slo(), name="slo-publisher")

    async def stop(self) -> None:
        await self.resumables.stop()
        if self._slo_task is not None:
            self._slo_task.cancel()
            await asyncio.gather(self._slo_task, return_exceptions=True)
        await self.router.stop()
        await self.handoff.background.drain()
        await self.http.aclose()
        await self.redis.aclose()

    async def _publish_slo(self) -> None:
        """Keeps the last minute's SLO attainment in Redis for ``baton status``."""
        every = self.settings.refresh_s * 2
        while True:
            try:
                attainment = self.metrics.slo_window.attainment()
                await publish_slo(self.redis, self.keys, attainment, every * 3)
            except RedisError as exc:  # transient: the next round writes it again
                log.warning("could not publish SLO attainment: %s", exc)
            await asyncio.sleep(every)

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

    @staticmethod
    def tenant(api_key: str | None) -> str | None:
        """Whose a resumable response is (a digest of the API key; None without keys)."""
        return None if api_key is None else hashlib.sha256(api_key.encode()).hexdigest()[:32]

    def parse(self, model_cls: type[Body], raw: bytes) -> Body:
        """A request body validated (400 naming the parameter), for the served model (404)."""
        try:
            body = model_cls.model_validate_json(raw)
        except ValidationError as exc:
            raise invalid_body(exc) from exc
        if body.model != self.model.name:
            raise model_not_found(body.model)
        return body

    def prepare(
        self, kind: Kind, raw: bytes, request_id: str, api_key: str | None = None
    ) -> tuple[Prepared, SamplingSpec]:
        body: ChatCompletionRequest | CompletionRequest = (
            self.parse(ChatCompletionRequest, raw)
            if kind == "chat"
            else self.parse(CompletionRequest, raw)
        )
        problem = body.problem() if isinstance(body, ChatCompletionRequest) else None
        if problem is not None:
            raise ServiceError(400, problem[1], code="invalid_request", param=problem[0])
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
        constraint = self._constraint(body)
        vocab = self.model.arch.vocab_size
        bias = body.bias()
        if any(t >= vocab for t in bias):
            raise ServiceError(
                400, f"logit_bias token ids must be in [0, {vocab})", code="invalid_request",
                param="logit_bias",
            )  # fmt: skip
        context = self.model.arch.max_position_embeddings
        limit = min(context, self.settings.max_prompt_tokens or context)
        if len(prompt) >= limit:
            raise ServiceError(
                400,
                f"the prompt has {len(prompt)} tokens; this model accepts at most {limit - 1}",
                code="context_length_exceeded",
                param="messages" if kind == "chat" else "prompt",
            )
        cap = self.settings.max_output_tokens
        requested = body.limit()
        if cap is not None and requested is not None and requested > cap:
            raise ServiceError(
                400,
                f"max_tokens ({requested}) is over this server's limit of {cap}",
                code="invalid_request",
                param="max_completion_tokens" if kind == "chat" else "max_tokens",
            )
        max_tokens = requested or min(context - len(prompt), cap or context)
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
            logit_bias=bias,
            constraint=ConstraintSpec.of(constraint),
        )
        echo = ""
        if isinstance(body, CompletionRequest) and body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else tok.decode(prompt)
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
            n=body.n,
            echo=echo,
            tools=body.tool_plan() if isinstance(body, ChatCompletionRequest) else None,
            resumable=body.resumable(),
        )
        return prepared, spec

    @staticmethod
    def _constraint(body: ChatCompletionRequest | CompletionRequest) -> Constraint | None:
        try:
            return body.constraint()
        except ValueError as exc:  # a schema given as text that is not JSON
            raise ServiceError(
                400, f"invalid structured_outputs: {exc}", code="invalid_request",
                param="structured_outputs",
            ) from exc  # fmt: skip

    async def check_constraint(self, spec: SamplingSpec) -> None:
        """A 400 naming the problem when the output constraint cannot be compiled (off
        the event loop: a large schema takes milliseconds; compiled ones are cached)."""
        if spec.constraint is None:
            return
        constraint = spec.constraint.to_constraint()
        try:
            await asyncio.to_thread(self.grammars.compile, constraint)
        except InvalidRequestError as exc:
            raise ServiceError(
                400, str(exc), code="invalid_request", param=_constraint_param(constraint)
            ) from exc

    async def admit(self, prepared: Prepared) -> None:
        retry = {"Retry-After": "1"}
        if self.in_flight + prepared.n > self.settings.max_in_flight:
            raise ServiceError(
                429, "too many requests in flight; retry later", code="overloaded", headers=retry
            )
        for role in self.roles:
            await self.router.catch_up(role)
            if not self.router.candidates(role):
                raise ServiceError(
                    503, f"no live {role} instance is available", code="no_live_instance"
                )
        first_role = self.roles[0]
        pending = [self.router.score(m, first_role) for m in self.router.candidates(first_role)]
        if (
            min(pending) + len(prepared.prompt) * prepared.n
            > self.settings.max_pending_prompt_tokens
        ):
            raise ServiceError(
                429, "prefill queues are full; retry later", code="overloaded", headers=retry
            )

    def narrow_schemas(self, schemas: dict[str, Any]) -> None:
        """What this deployment accepts, in the request schemas: its one model name, and
        the output cap when one is set (a client or fuzzer then sees the real bounds)."""
        cap = self.settings.max_output_tokens
        for name, limits in (
            ("ChatCompletionRequest", ("max_tokens", "max_completion_tokens")),
            ("CompletionRequest", ("max_tokens",)),
        ):
            props = schemas[name]["properties"]
            props["model"] = {"type": "string", "enum": [self.model.name], "title": "Model"}
            for field in limits if cap is not None else ():
                props[field]["anyOf"][0]["maximum"] = cap

    def model_card(self) -> dict[str, Any]:
        """The model as ``/v1/models`` lists it (``created``: the oldest live decode's start)."""
        decode = self.router.candidates(self.roles[-1])
        created = int(min((m.started_at for m in decode), default=time.time()))
        return {
            "id": self.model.name,
            "object": "model",
            "created": created,
            "owned_by": "baton",
            "max_model_len": self.model.arch.max_position_embeddings,
            # what the live instances compute in (--dtype auto picks per machine)
            "dtype": sorted({m.dtype for m in decode if m.dtype}),
        }

    def refresh_gauges(self) -> None:
        self.metrics.in_flight.set(self.in_flight)
        for role, depth in self.router.queue_depths().items():
            self.metrics.queue.labels(role).set(depth)
            self.metrics.live.labels(role).set(len(self.router.live(role)))
        for role, n in self.router.lent().items():
            self.metrics.lent.labels(role).set(n)


def invalid_body(exc: ValidationError) -> ServiceError:
    """A 400 naming the first offending parameter, in OpenAI's words where it has them."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    kind, message = first["type"], first["msg"].removeprefix("Value error, ")
    if kind == "json_invalid":
        message = "invalid JSON body"
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif kind == "missing":
        message = f"'{param}' is a required property"
    elif param is not None:
        message = f"invalid '{param}': {message}"
    return ServiceError(400, message, code="invalid_request", param=param)


def model_not_found(model: str) -> ServiceError:
    return ServiceError(
        404, f"The model '{model}' does not exist", code="model_not_found", param="model"
    )


def tenant_salt(api_key: str, requested: str | None) -> str:
    """A salt unique to an API key (and the request's own salt, if any); the key itself
    never leaves the gateway."""
    tenant = hashlib.sha256(api_key.encode()).hexdigest()[:32]
    return f"key:{tenant}" if requested is None else f"key:{tenant}|{requested}"
