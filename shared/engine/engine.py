"""The in-process engine: add requests, step, collect outputs, abort.

``step`` is the whole loop body: schedule, execute, update. Everything the
services build (prefill, decode, the colocated baseline) drives this API and
moves KV in and out only through the engine's :class:`KVConnector`; the
engine is the reference the disaggregated path is compared against token by
token. After every step and command the engine can describe itself in an
immutable :class:`EngineSnapshot`, which other threads read instead of its
live state.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from shared.config import EngineConfig, default_cache_dir
from shared.engine.cuda_graphs import DecodeGraphs
from shared.engine.grammar import GrammarCompiler
from shared.engine.host_swap import build_swap
from shared.engine.kv_cache_manager import KVCacheManager
from shared.engine.kv_connector import KVConnector
from shared.engine.kv_events import KVEvents
from shared.engine.model_runner import ModelRunner
from shared.engine.output_processor import OutputProcessor
from shared.engine.outputs import Completion, RequestOutput
from shared.engine.request import (
    FinishReason,
    Request,
    RequestId,
    SampledToken,
    TokenLogprobs,
)
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.engine.scheduler_output import SchedulerOutput
from shared.engine.snapshot import EngineSnapshot
from shared.errors import InvalidRequestError
from shared.heap import keep_freed_memory
from shared.kv.block_hash import BlockHasher
from shared.kv.kv_cache import KVCache
from shared.kv.layer_groups import LayerGroups
from shared.kv.layout import KVLayout, dtype_name
from shared.model.arch import ModelArch
from shared.model.attention_impl import AttentionImpl, select_attention
from shared.model.decode_attention import TritonDecode
from shared.model.loader import LoadedModel, load_model


class Engine:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, connector: KVConnector | None = None
    ):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        keep_freed_memory()  # each step's temporaries stay mapped for the next
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
            self._layer_groups(arch, loaded.model.device),
        )
        if config.cache.prefault:
            self.kv_cache.prefault()
        attention = select_attention(
            config.attention,
            loaded.model.dtype,
            arch.head_dim,
            config.device,
            config.kernel_dir,
            block_size=config.cache.block_size,
        )
        self.max_model_len = arch.max_position_embeddings
        graphs = self._decode_graphs(loaded, attention)
        self.hasher = BlockHasher(
            namespace=f"{loaded.identity}|{self.layout.describe()}",
            block_size=config.cache.block_size,
        )
        # decode graphs pad batches on the pool's last block, which no request gets
        self.kv = KVCacheManager(
            self.kv_cache.num_blocks - (graphs is not None),
            self.hasher,
            enable_caching=config.cache.enable_prefix_caching,
            groups=self.kv_cache.groups,
            window_hold=None if connector is None else connector.window_hold,
            on_part=self.kv_cache.set_part if self.kv_cache.windowed else None,
        )
        if self.kv_cache.windowed:
            self.kv_cache.bind_parts(self.kv.window_part)
        self.connector = connector
        if connector is not None:
            connector.bind(self.kv_cache)
        self.swap_space, self.swapper = build_swap(config, self.kv_cache)
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            max_model_len=self.max_model_len,
            eos_token_ids=self.tokenizer.eos_token_ids,
            connector=connector,
            swapper=self.swapper,
        )
        self.scheduler.set_threads(torch.get_num_threads())
        self.runner = ModelRunner(loaded.model, self.kv_cache, attention, graphs)
        self.output = OutputProcessor(self.tokenizer, self.scheduler.finish)
        self.grammars = GrammarCompiler(
            self.tokenizer.to_json(), arch.vocab_size, self.tokenizer.eos_token_ids
        )
        self._next_id = 0
        self._steps = 0
        self.last_step_tokens = 0  # tokens the last step computed (0: nothing was runnable)
        # called on the engine thread after each layer's K/V are written (before they
        # are saved): it may change the thread count (see shared.engine.elastic_threads)
        self.between_layers: Callable[[], None] | None = None

    def _layer_groups(self, arch: ModelArch, device: str) -> LayerGroups:
        """The pool's layer groups: sliding-window layers apart (they keep only their
        window's blocks) where the config allows and the pool is on the CPU."""
        windows = [arch.window(i) for i in range(arch.num_layers)]
        if not self.config.cache.sliding_window_kv or device != "cpu":
            return LayerGroups.full(arch.num_layers)
        return LayerGroups.split(windows)

    def _decode_graphs(self, loaded: LoadedModel, attention: AttentionImpl) -> DecodeGraphs | None:
        """CUDA graphs of decode steps, where the config asks for them and they can run:
        a CUDA device, the Triton decode attention, a pool of more than one block."""
        config = self.config
        if not (config.cuda_graphs and config.device.startswith("cuda")):
            return None
        if not isinstance(attention.decode, TritonDecode) or self.kv_cache.num_blocks < 2:
            return None
        return DecodeGraphs(
            loaded.model,
            self.kv_cache,
            attention,
            max_batch=config.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            scratch_slot=self.kv_cache.num_blocks - 1,
        )

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        cache_dir: Path | None = None,
        progress: bool = True,
        connector: KVConnector | None = None,
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
        return cls(loaded, config, connector)

    # -- requests ------------------------------------------------------------
    def new_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        seed: int | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """A validated request with its block keys, not yet added. Reads only immutable
        state (and the thread-safe grammar cache, which compiles its output constraint
        here, off the engine's steps), so any thread may call it (the services plan
        transfers with its keys)."""
        self.validate(prompt_token_ids, params.max_tokens)
        if params.constraint is not None:
            self.grammars.compile(params.constraint)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if seed is None:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
        req = Request(
            request_id=RequestId(request_id),
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            seed=seed,
            arrival=time.perf_counter(),
            cache_salt=cache_salt,
        )
        self.hasher.extend(req.block_keys, req.prompt_token_ids, cache_salt)
        return req

    def add(
        self,
        req: Request,
        *,
        kv_transfer: object | None = None,
        awaiting_first_token: bool = False,
        generated: Sequence[int] = (),
        detokenize: bool = True,
        whole_max_tokens: int | None = None,
    ) -> RequestId:
        """Queue ``req``. ``kv_transfer`` is what the connector needs to move its KV;
        ``awaiting_first_token``: prefilled elsewhere, it computes nothing until
        :meth:`supply_first_token` (its outputs then start with the second token);
        ``generated``: tokens it already produced elsewhere (a resumed request: its
        outputs continue after them, sampled exactly as they would have been there);
        ``whole_max_tokens``: the whole request's max_tokens when this engine computes
        only part of it (prefill: the first token), which its output constraint
        plans for."""
        if generated:
            if awaiting_first_token:
                raise InvalidRequestError("a resumed request already has its first token")
            if len(generated) >= req.params.max_tokens:
                raise InvalidRequestError("a resumed request has no tokens left to generate")
            vocab = self.loaded.arch.vocab_size
            if any(not 0 <= t < vocab for t in generated):
                raise InvalidRequestError(f"generated token ids must be in [0, {vocab})")
            req.output_token_ids = list(generated)
        if req.params.constraint is not None:  # where its grammar stands after `generated`
            budget = self.scheduler.limits.output_budget(req, whole_max_tokens)
            req.matcher = self.grammars.matcher(req.params.constraint, budget)
            req.matcher.replay(req.output_token_ids)
        req.kv_transfer = kv_transfer
        req.awaiting_first_token = awaiting_first_token
        self.scheduler.add(req)
        self.output.add(req, detokenize=detokenize)
        return req.request_id

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        detokenize: bool = True,
    ) -> RequestId:
        req = self.new_request(
            prompt_token_ids, params, request_id=request_id, cache_salt=cache_salt
        )
        return self.add(req, detokenize=detokenize)

    def supply_first_token(self, request_id: str, token: SampledToken) -> None:
        self.scheduler.supply_first_token(RequestId(request_id), token)

    def validate(self, prompt_token_ids: Sequence[int], max_tokens: int) -> None:
        """Raise InvalidRequestError (or RequestTooLongError) for a request this engine
        cannot run; reads only immutable configuration, so any thread may call it."""
        vocab = self.loaded.arch.vocab_size
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        self.scheduler.limits.check_fits(len(prompt_token_ids), max_tokens)

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its KV; False when the id is unknown or already done."""
        self.output.forget(RequestId(request_id))
        return self.scheduler.finish(RequestId(request_id), FinishReason.ABORT) is not None

    def set_num_threads(self, n: int) -> None:
        """Threads the next steps compute on (the results do not depend on it; a lone
        prompt's chunks grow with them)."""
        torch.set_num_threads(n)
        self.scheduler.set_threads(n)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ----------------------------------------------------------------
    def step(self, *, defer_copies: bool = False) -> list[RequestOutput]:
        """Schedule and run one batch; its outputs. ``defer_copies``: copies out of the
        pool that the connector may make after the outputs left (see
        :meth:`KVConnector.flush`) wait for :meth:`flush_copies`, which the caller
        runs once it handed the outputs over (or the next step does, first)."""
        if self.connector is not None:
            self.connector.flush()  # before any slot can be reused
            self.scheduler.on_connector_events(self.connector.poll())
        scheduled = self.scheduler.schedule()
        self._swap_blocks(scheduled)
        t0 = time.perf_counter()
        sampled, failed = self._execute(scheduled)
        if self.swapper is not None:
            tokens = scheduled.num_batched_tokens
            self.swapper.cost.observe_compute(tokens, time.perf_counter() - t0)
        outputs = self.output.outputs(self.scheduler.update(scheduled, sampled, failed))
        if not defer_copies:
            self.flush_copies()
        return outputs

    def flush_copies(self) -> None:
        """The copies out of the pool the last step deferred past its outputs."""
        if self.connector is not None:
            self.connector.flush()

    def _swap_blocks(self, scheduled: SchedulerOutput) -> None:
        """Preempted requests' blocks out to host memory, resumed ones' back in."""
        swapper, space = self.swapper, self.swap_space
        if not scheduled.swaps or swapper is None or space is None:
            return
        timing = space.run(scheduled.swaps)
        swapper.cost.observe_copy(timing.nbytes, timing.seconds)

    def _execute(
        self, scheduled: SchedulerOutput
    ) -> tuple[dict[RequestId, SampledToken], frozenset[RequestId]]:
        """Run the model; with a connector, layer i waits for its loads and is saved."""
        self.last_step_tokens = scheduled.num_batched_tokens
        if scheduled.is_empty:
            return {}, frozenset()
        self._steps += 1
        self.output.scheduled(scheduled, time.perf_counter())
        connector, between = self.connector, self.between_layers
        if connector is None:
            hook = None if between is None else (lambda _layer, _step: between())
            return self.runner.execute(scheduled, hook), frozenset()

        def on_layer(layer: int, step: SchedulerOutput) -> None:
            if between is not None:
                between()
            connector.wait_for_layer(layer)
            connector.save_layer(layer, step)

        try:
            sampled = self.runner.execute(scheduled, on_layer)
        finally:
            failed = connector.end_step()
        return sampled, failed

    def take_kv_events(self) -> KVEvents:
        """Block keys this engine's pool started or stopped holding since the last call."""
        return self.kv.take_events()

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot.of(self.scheduler, self.swapper, steps=self._steps)

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
