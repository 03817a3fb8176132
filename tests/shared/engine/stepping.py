"""Driving a scheduler without a model, for the scheduler's and preemption's tests: a real
KV cache manager and block keys; KV movement through a fake connector the test drives."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from shared.config import SchedulerConfig
from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.request import Request, RequestId, SampledToken
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.engine.scheduler_output import SchedulerOutput
from shared.engine.swap import Swapper
from shared.kv.block_hash import BlockHasher
from tests.shared.engine.fake_connector import FakeConnector

EOS = 2
_ids = itertools.count()


def make(
    num_blocks: int = 64,
    budget: int = 64,
    max_seqs: int = 8,
    block_size: int = 4,
    chunked: bool = True,
    chunk_cap: int = 0,
    connector: FakeConnector | None = None,
    swapper: Swapper | None = None,
    caching: bool = True,
    shortest_first: bool = False,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=chunk_cap,
            shortest_prompt_first=shortest_first,
        ),
        KVCacheManager(
            num_blocks,
            BlockHasher(namespace="test", block_size=block_size),
            enable_caching=caching,
        ),
        max_model_len=256,
        eos_token_ids=(EOS,),
        connector=connector,
        swapper=swapper,
    )


def req(n_prompt: int, max_tokens: int = 4, first: int = 10) -> Request:
    return Request(
        request_id=RequestId(f"r{next(_ids)}"),
        prompt_token_ids=list(range(first, first + n_prompt)),
        params=SamplingParams(max_tokens=max_tokens, temperature=0),
        seed=0,
        arrival=0.0,
    )


def run_until(s: Scheduler, done: Callable[[], bool], limit: int = 100) -> None:
    """Step until ``done()``; fails (rather than hangs) after ``limit`` steps."""
    for _ in range(limit):
        if done():
            return
        run_step(s)
    raise AssertionError(f"not reached in {limit} steps")


def run_step(s: Scheduler, token: int = 100) -> SchedulerOutput:
    """Schedule and pretend the model sampled ``token`` for every sampling request (the
    engine's step, with the connector's poll before and its failures after)."""
    connector = s.connector if isinstance(s.connector, FakeConnector) else None
    if connector is not None:
        s.on_connector_events(connector.poll())
    out = s.schedule()
    failed = connector.end_step() if connector is not None else frozenset()
    sampled = {x.request.request_id: SampledToken(token) for x in out.scheduled if x.samples}
    s.update(out, sampled, failed)
    return out


def assert_idle(s: Scheduler) -> None:
    """Nothing queued, loading or running, and every slot back in the pool."""
    assert not s.has_unfinished() and not s.queues.requests and not s.queues.releasing
    assert s.kv.num_free == s.kv.num_slots
