"""The colocated baseline: one engine serves both phases with mixed batching (chunked
prefills share steps with running decodes: Splitwise's baseline, vLLM's default),
behind the same gateway API. Started from the decode service with
``BATON_DECODE_COLOCATED=true``; it registers as role ``colocated`` and the
gateway (``BATON_GATEWAY_MODE=colocated``) sends it whole requests."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator

from pydantic import BaseModel

from services.decode.settings import DecodeSettings
from shared.config import BatonSettings
from shared.errors import InvalidRequestError
from shared.serving.protocol import Accepted, PrefillRequest
from shared.serving.token_stream import TokenStream
from shared.serving.worker import Worker

log = logging.getLogger(__name__)


class Colocated(Worker):
    settings: DecodeSettings
    role = "colocated"

    def __init__(self, settings: DecodeSettings, baton: BatonSettings):
        super().__init__(settings, baton)

    def load(self) -> dict[str, float]:
        snap = self.loop.snapshot
        return {"running": float(snap.running), "pending_tokens": float(snap.pending_tokens)}

    async def run(self, req: PrefillRequest) -> AsyncGenerator[BaseModel, None]:
        """The whole request here: ``accepted``, then every token (the first included)."""
        self.engine.validate(req.prompt_token_ids, req.sampling.max_tokens)
        if req.request_id in self.in_flight:
            raise InvalidRequestError(f"request id {req.request_id} is already running")
        arrival = time.perf_counter()
        self.in_flight[req.request_id] = req
        outputs = self.loop.subscribe(req.request_id)
        finished = False
        try:
            await self.loop.call(
                lambda e: e.add_request(
                    req.prompt_token_ids,
                    req.sampling.to_params(),
                    request_id=req.request_id,
                    cache_salt=req.cache_salt,
                    detokenize=False,
                )
            )
            yield Accepted(instance_id=self.instance_id)
            tokens = TokenStream()
            async for event in tokens.events(outputs):
                yield event
            finished = True
            self._observe_prompt(len(req.prompt_token_ids), tokens)
            log.info(
                "generated %d tokens after a %d-token prompt in %.3fs (%s)",
                tokens.generated,
                len(req.prompt_token_ids),
                time.perf_counter() - arrival,
                tokens.finish_reason,
            )
        finally:
            self.loop.unsubscribe(req.request_id)
            self.in_flight.pop(req.request_id, None)
            if not finished:
                self.loop.post(lambda e: e.abort(req.request_id))

    def _observe_prompt(self, num_prompt_tokens: int, tokens: TokenStream) -> None:
        """The prompt's reuse and phases (Baton's series and vLLM's), once it has ended."""
        if tokens.cache_hit is not None:
            self.connector_metrics.observe_hit(num_prompt_tokens, tokens.cache_hit)
        t = tokens.timings
        if t is not None and t.first_token is not None:
            started = t.scheduled if t.scheduled is not None else t.arrival
            self.metrics.observe_prompt_phases(started - t.arrival, t.first_token - started)
