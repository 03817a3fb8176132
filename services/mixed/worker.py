"""A mixed-pool instance: one engine that serves prefill and decode (Splitwise's mixed
pool).

It registers as its home role (``BATON_MIXED_HOME``) and serves both APIs on one
port: ``POST /v1/prefill`` as a prefill instance does and ``POST /v1/decode`` as a
decode instance does, over one engine and one KV-store connector, so a prompt
chunk and running streams share its steps (chunked, so a stream's token waits for
at most one chunk). Which work it gets is the gateway's choice
(:mod:`services.gateway.router`): its home role's, and the other role's while its
own queue is empty and the other role's is over its bound. Its load report says
what it is serving at the moment (``serving_prefill``: prompts here,
``serving_decode``: streams here).

A request prefilled and decoded here runs as two engine requests (the prefill one
under ``<id>#prefill``); the decode one reuses the prompt's blocks from this pool
once the prefill has cached them, else it loads them from the store like any
decode.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from pydantic import BaseModel

from services.decode.decoder import Decoder
from services.mixed.settings import MixedSettings
from services.prefill.prefiller import Prefiller
from shared.config import BatonSettings
from shared.engine.step_pacer import StepPacer
from shared.serving.protocol import DecodeRequest, PrefillRequest

PREFILL_TAG = "#prefill"


def prefill_id(request_id: str) -> str:
    """The engine request id of a prompt prefilled on a mixed instance."""
    return request_id + PREFILL_TAG


def is_prefill(request_id: str) -> bool:
    return request_id.endswith(PREFILL_TAG)


class Mixed(Prefiller, Decoder):
    settings: MixedSettings

    def __init__(self, settings: MixedSettings, baton: BatonSettings):
        self.role = settings.home  # registration, metrics and ids use the home role
        super().__init__(settings, baton)

    make_connector = Decoder.make_connector  # replicating, and writing prompts (below)

    def step_pacer(self) -> StepPacer | None:
        """Never paced: the slack a TPOT target leaves goes to the prompts lent here
        (computed in the same steps as the streams: issue 31's runs at 3 and 4 req/s
        served fewer requests within target with a paced mixed decode instance than
        with an unpaced one, 63/27% against 100/37%, the two ways of giving the slack
        to prefill competing for it)."""
        return None

    def put_options(self) -> dict[str, Any]:
        return {"pull_policy": self.settings.pull_policy, "put_ttl_s": self.settings.put_ttl_s}

    def load(self) -> dict[str, float]:
        """Each role's queue counts only that role's requests (the engine's figures mix
        them): ``pending_tokens`` and ``jobs`` the prompts, ``running`` and
        ``waiting_kv`` the streams."""
        snap = self.loop.snapshot
        prompts = [rid for rid in self.in_flight if is_prefill(rid)]
        streams = len(self.in_flight) - len(prompts)
        waiting = sum(1 for rid in snap.waiting_ids if not is_prefill(rid))
        pending = sum(n for rid, n in snap.pending_by_request.items() if is_prefill(rid))
        return {
            "pending_tokens": float(pending),
            "jobs": float(len(prompts)),
            "running": float(max(0, streams - waiting)),
            "waiting_kv": float(waiting),
            "mixed": 1.0,
            "serving_prefill": float(len(prompts)),
            "serving_decode": float(streams),
        }

    def release_requests(self) -> None:
        """Draining: streams move to another decode instance; prompts finish here."""
        for rid in list(self.in_flight):
            if not is_prefill(rid):
                self.loop.interrupt(rid)

    async def run(self, body: PrefillRequest | DecodeRequest) -> AsyncGenerator[BaseModel, None]:
        if isinstance(body, DecodeRequest):
            async for event in Decoder.run(self, body):
                yield event
            return
        tagged = body.model_copy(update={"request_id": prefill_id(body.request_id)})
        async for event in Prefiller.run(self, tagged):
            yield event
