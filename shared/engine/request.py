"""A request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

from shared.engine.sampling_params import SamplingParams
from shared.kv.block_hash import BlockKey

if TYPE_CHECKING:
    from shared.engine.grammar import Matcher
    from shared.engine.kv_cache_manager import Slot
    from shared.engine.swap import SwappedOut

RequestId = NewType("RequestId", str)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # an asynchronous load fills its slots
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


@dataclass(frozen=True)
class CacheHit:
    """Prompt tokens a request did not compute here: from the local pool or loaded."""

    local_tokens: int = 0
    external_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.local_tokens + self.external_tokens


@dataclass(eq=False)
class Request:
    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or one drawn at admission so a rerun reproduces this request
    arrival: float
    cache_salt: str | None = None
    # what the KV connector needs to move this request's blocks (opaque to the engine)
    kv_transfer: object | None = None
    # prefilled elsewhere: its first token arrives later and nothing is computed before
    awaiting_first_token: bool = False
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    admitted: float | None = None  # when it first got slots (perf_counter)
    cache_hit: CacheHit = CacheHit()  # at its first admission
    load_external: bool = True  # False once a load failed: recompute instead
    # keys of its full blocks, computed once (the KV cache manager extends them)
    block_keys: list[BlockKey] = field(default_factory=list)
    # written only by the KV cache manager: its pool slots, how many leading blocks
    # are registered in the prefix cache, and (sliding-window layers) the first block
    # whose window part it holds
    slots: list[Slot] = field(default_factory=list)
    num_cached_blocks: int = 0
    window_from: int = 0
    finish_reason: FinishReason | None = None
    # preempted with its KV in host memory (shared.engine.swap); None otherwise
    swapped: SwappedOut | None = None
    # preempted with its KV kept by the connector (a spill), until it loads back
    spilled: bool = False
    # its position in its output constraint's grammar (params.constraint), if any
    matcher: Matcher | None = None

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
    def num_cached_tokens(self) -> int:
        return self.cache_hit.tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token: SampledToken) -> bool:
        """Take ``token`` as the next output (and advance the grammar, if constrained);
        False when the grammar does not allow it."""
        self.output_token_ids.append(token.token_id)
        if token.logprobs is not None:
            self.output_logprobs.append(token.logprobs)
        return self.matcher is None or self.matcher.accept(token.token_id)

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]
