"""From the requests a step changed to the :class:`RequestOutput` values the engine
hands back: incremental detokenization with stop strings, and each request's timings.

Engine-thread only, like the scheduler: the engine registers a request when it is
added, forgets it when it is aborted, and passes every step's changed requests
through :meth:`OutputProcessor.outputs`. A stop string ends a request through the
``finish`` callback (the scheduler frees its slots); the outputs it returns are
plain values other threads may keep.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.outputs import RequestOutput, RequestTimings
from shared.engine.request import FinishReason, Request, RequestId
from shared.engine.scheduler_output import SchedulerOutput
from shared.model.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, finish: Callable[[RequestId, FinishReason], object]):
        self.tokenizer = tokenizer
        self.finish = finish  # ends a request that hit a stop string
        self._detok: dict[RequestId, IncrementalDetokenizer] = {}
        self.timings: dict[RequestId, RequestTimings] = {}  # of the requests not finished

    def add(self, req: Request, *, detokenize: bool) -> None:
        """Follow ``req``; its text is detokenized when asked or when it has stop strings."""
        if detokenize or req.params.stop:
            self._detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, stop=req.params.stop
            )
        self.timings[req.request_id] = RequestTimings(arrival=req.arrival)

    def forget(self, request_id: RequestId) -> None:
        self._detok.pop(request_id, None)
        self.timings.pop(request_id, None)

    def scheduled(self, step: SchedulerOutput, now: float) -> None:
        """Note when each request's first step began."""
        for s in step.scheduled:
            timing = self.timings.get(s.request.request_id)
            if timing is not None and timing.scheduled is None:
                timing.scheduled = now

    def outputs(self, changed: Iterable[Request]) -> list[RequestOutput]:
        now = time.perf_counter()
        return [self._output(req, now) for req in changed]

    def _output(self, req: Request, now: float) -> RequestOutput:
        new_ids = req.output_token_ids[-1:]
        text = ""
        detok = self._detok.get(req.request_id)
        if detok is not None:
            text = detok.add(new_ids)
            if detok.stopped_by is not None and not req.is_finished:
                self.finish(req.request_id, FinishReason.STOP)
            if req.is_finished:
                text += detok.finish()
                del self._detok[req.request_id]
        timing = self.timings[req.request_id]
        timing.admitted = req.admitted
        if timing.first_token is None:
            timing.first_token = now
        if req.is_finished:
            timing.finished = now
            del self.timings[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=text,
            new_logprobs=req.output_logprobs[-1:] if req.params.logprobs is not None else [],
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            cache_hit=req.cache_hit,
            timings=timing if req.is_finished else None,
        )
