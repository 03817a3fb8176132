"""The in-process engine: add requests, step, collect outputs, abort.

``step`` is the whole loop body: schedule, execute, update. Everything the
services build (prefill, decode, the colocated baseline) drives this API, and
it is the reference the disaggregated path is compared against token by token.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.config import EngineConfig, default_cache_dir
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.model_runner import LayerHook, ModelRunner
from shared.engine.request import (
    FinishReason,
    Request,
    RequestId,
    SampledToken,
    TokenLogprobs,
)
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.errors import InvalidRequestError, RequestTooLongError
from shared.kv.block_hash import BlockHasher
from shared.kv.block_pool import BlockId, BlockPool
from shared.kv.kv_cache import KVCache
from shared.kv.layout import KVLayout, dtype_name
from shared.model.attention_impl import select_attention
from shared.model.loader import LoadedModel, load_model


@dataclass
class RequestTimings:
    arrival: float
    first_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: RequestId
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    timings: RequestTimings | None = None  # set on the finishing output


@dataclass(frozen=True)
class Completion:
    """A finished request, as :meth:`Engine.generate` returns it."""

    request_id: RequestId
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: FinishReason
    num_cached_tokens: int
    timings: RequestTimings = field(compare=False)


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        arch = loaded.arch
        self.layout = KVLayout(
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            block_size=config.cache.block_size,
            dtype=dtype_name(loaded.model.dtype),  # the KV pool holds what the model computes
        )
        self.kv_cache = KVCache.for_memory(
            self.layout,
            config.cache.kv_cache_bytes,
            loaded.model.device,
            config.cache.huge_pages,
        )
        if config.cache.prefault:
            self.kv_cache.prefault()
        self.block_pool = BlockPool(
            self.kv_cache.num_blocks, enable_caching=config.cache.enable_prefix_caching
        )
        self.hasher = BlockHasher(
            namespace=f"{loaded.identity}|{self.layout.describe()}",
            block_size=config.cache.block_size,
        )
        self.max_model_len = arch.max_position_embeddings
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_pool,
            self.hasher,
            max_model_len=self.max_model_len,
            eos_token_ids=self.tokenizer.eos_token_ids,
        )
        attention = select_attention(
            config.attention, loaded.model.dtype, arch.head_dim, config.device, config.kernel_dir
        )
        self.runner = ModelRunner(loaded.model, self.kv_cache, attention)
        self._detok: dict[RequestId, IncrementalDetokenizer] = {}
        self.timings: dict[RequestId, RequestTimings] = {}
        self._next_id = 0
        self.last_step_tokens = 0  # tokens the last step computed (0: nothing was runnable)

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, cache_dir: Path | None = None, progress: bool = True
    ) -> Engine:
        loaded = load_model(
            config.model,
            cache_dir=cache_dir or default_cache_dir(),
            dtype=config.dtype,
            device=config.device,
            linear=config.linear,
            pointwise=config.pointwise,
            kernel_dir=config.kernel_dir,
            progress=progress,
        )
        return cls(loaded, config)

    # -- requests ------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        detokenize: bool = True,
    ) -> RequestId:
        self.validate(prompt_token_ids, params.max_tokens)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        req = self._new_request(request_id, prompt_token_ids, params, seed, cache_salt)
        self.scheduler.add(req)
        return self._track(req, detokenize=detokenize)

    def _new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        seed: int,
        cache_salt: str | None,
    ) -> Request:
        return Request(
            request_id=RequestId(request_id),
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            seed=seed,
            arrival=time.perf_counter(),
            cache_salt=cache_salt,
        )

    def _track(self, req: Request, *, detokenize: bool) -> RequestId:
        """Detokenizer (also needed for stop strings) and timings of an admitted request."""
        if detokenize or req.params.stop:
            self._detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, stop=req.params.stop
            )
        self.timings[req.request_id] = RequestTimings(arrival=req.arrival)
        return req.request_id

    def validate(self, prompt_token_ids: Sequence[int], max_tokens: int) -> None:
        """Raise InvalidRequestError (or RequestTooLongError) for a request this engine
        cannot run; reads only immutable configuration, so any thread may call it."""
        vocab = self.loaded.arch.vocab_size
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        total = len(prompt_token_ids) + max_tokens
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({max_tokens}) = "
                f"{total} exceeds the context length {self.max_model_len}"
            )
        bs = self.layout.block_size
        if -(-total // bs) > self.block_pool.num_blocks:
            raise RequestTooLongError(
                f"{total} tokens need more KV blocks than this instance has "
                f"({self.block_pool.num_blocks} x {bs} tokens)"
            )

    def add_prefilled(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        first: SampledToken,
        block_ids: Sequence[BlockId],
        *,
        request_id: str,
        seed: int,
        cache_salt: str | None = None,
    ) -> RequestId:
        """Continue a request prefilled elsewhere: its prompt KV is already in ``block_ids``
        (taken with :meth:`reserve_blocks`; the request owns them from now on) and
        ``first`` is the token prefill sampled. Outputs start with the second token."""
        self.validate([*prompt_token_ids, first.token_id], params.max_tokens - 1)
        req = self._new_request(request_id, prompt_token_ids, params, seed, cache_salt)
        req.output_token_ids = [first.token_id]
        req.output_logprobs = [first.logprobs] if first.logprobs is not None else []
        req.block_ids = list(block_ids)
        try:
            self.scheduler.add_prefilled(req)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        return self._track(req, detokenize=False)

    # -- KV blocks outside the scheduler (transfers) ---------------------------------
    def reserve_blocks(self, n: int) -> list[BlockId] | None:
        """Take ``n`` blocks for KV arriving from elsewhere, or None when that would not
        leave one block of growth per running request (admission by free KV memory)."""
        headroom = len(self.scheduler.running) + len(self.scheduler.prefilled)
        if n + headroom > self.block_pool.num_free:
            return None
        return self.block_pool.allocate(n)

    def free_blocks(self, block_ids: Sequence[BlockId]) -> None:
        """Give back blocks from :meth:`reserve_blocks` (or drop :meth:`pin_blocks` refs)."""
        self.block_pool.release(reversed(block_ids))

    def pin_blocks(self, block_ids: Sequence[BlockId]) -> None:
        """Keep blocks from being reused (e.g. while a transfer reads them), even if
        their request finishes or is preempted meanwhile; undo with :meth:`free_blocks`."""
        self.block_pool.acquire(block_ids)

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its KV; False when the id is unknown or already done."""
        self._detok.pop(RequestId(request_id), None)
        self.timings.pop(RequestId(request_id), None)
        return self.scheduler.finish(RequestId(request_id), FinishReason.ABORT) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ----------------------------------------------------------------
    def step(self, on_layer: LayerHook | None = None) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        sampled = self.runner.execute(scheduled, on_layer) if not scheduled.is_empty else {}
        self.last_step_tokens = scheduled.num_batched_tokens
        return self._outputs(self.scheduler.update(scheduled, sampled))

    def _outputs(self, changed: list[Request]) -> list[RequestOutput]:
        now = time.perf_counter()
        outs: list[RequestOutput] = []
        for req in changed:
            new_ids = req.output_token_ids[-1:]
            text = ""
            detok = self._detok.get(req.request_id)
            if detok is not None:
                text = detok.add(new_ids)
                if detok.stopped_by is not None and not req.is_finished:
                    self.scheduler.finish(req.request_id, FinishReason.STOP)
                if req.is_finished:
                    text += detok.finish()
                    del self._detok[req.request_id]
            timing = self.timings[req.request_id]
            if timing.first_token is None:
                timing.first_token = now
            if req.is_finished:
                timing.finished = now
                del self.timings[req.request_id]
            outs.append(
                RequestOutput(
                    request_id=req.request_id,
                    new_token_ids=new_ids,
                    new_text=text,
                    new_logprobs=req.output_logprobs[-1:]
                    if req.params.logprobs is not None
                    else [],
                    finished=req.is_finished,
                    finish_reason=req.finish_reason,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_output_tokens=len(req.output_token_ids),
                    num_cached_tokens=req.num_cached_tokens,
                    timings=timing if req.is_finished else None,
                )
            )
        return outs

    # -- convenience -------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Run ``prompts`` to completion together (one continuous batch)."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        tokens: dict[RequestId, list[int]] = {i: [] for i in ids}
        texts: dict[RequestId, list[str]] = {i: [] for i in ids}
        logprobs: dict[RequestId, list[TokenLogprobs]] = {i: [] for i in ids}
        final: dict[RequestId, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.new_text)
                logprobs[out.request_id].extend(out.new_logprobs)
                if out.finished:
                    final[out.request_id] = out
        results = []
        for rid, prompt in zip(ids, prompts, strict=True):
            out = final[rid]
            if out.finish_reason is None or out.timings is None:
                raise RuntimeError(f"engine finished {rid} without a reason or timings")
            results.append(
                Completion(
                    request_id=rid,
                    prompt_token_ids=list(prompt),
                    token_ids=tokens[rid],
                    text="".join(texts[rid]),
                    logprobs=logprobs[rid],
                    finish_reason=out.finish_reason,
                    num_cached_tokens=out.num_cached_tokens,
                    timings=out.timings,
                )
            )
        return results
