"""A request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

from shared.engine.sampling_params import SamplingParams
from shared.kv.block_hash import BlockHash
from shared.kv.block_pool import BlockId

RequestId = NewType("RequestId", str)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of the chosen token and the ``top`` most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass(eq=False)
class Request:
    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or one drawn at admission so a rerun reproduces this request
    arrival: float
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    num_cached_tokens: int = 0  # prefix tokens served from the prefix cache at admission
    block_ids: list[BlockId] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_indexed_blocks: int = 0  # leading blocks already registered in the prefix cache
    finish_reason: FinishReason | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]
