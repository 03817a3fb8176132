"""What one engine accepts and when a request stops: pure checks on its fixed limits,
shared by the engine's edge validation and the scheduler (any thread may call them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.kv_cache_manager import cdiv
from shared.engine.request import FinishReason, Request
from shared.errors import InvalidRequestError, RequestTooLongError


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int  # prompt + output tokens
    block_size: int
    num_slots: int  # slots of the KV pool: one request may not hold more at once
    eos_token_ids: tuple[int, ...] = ()
    # the most slots a request of so many tokens holds at once (None: a block each)
    slots_for: Callable[[int], int] | None = None

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise for a request this engine can never run, whatever else it is running."""
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty")
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{total} exceeds the context length {self.max_model_len}"
            )
        need = cdiv(total, self.block_size) if self.slots_for is None else self.slots_for(total)
        if need > self.num_slots:
            raise RequestTooLongError(
                f"{total} tokens need more KV blocks than this instance has "
                f"({self.num_slots} x {self.block_size} tokens)"
            )

    def output_budget(self, req: Request, max_tokens: int | None = None) -> int:
        """The most output tokens ``req`` may write: its max_tokens (or ``max_tokens``),
        or the context's room."""
        asked = req.params.max_tokens if max_tokens is None else max_tokens
        return min(asked, self.max_model_len - req.num_prompt_tokens)

    def stop_reason(
        self, req: Request, token: int, num_outputs: int | None = None
    ) -> FinishReason | None:
        """Why ``req`` stops once ``token`` is its latest output (its ``num_outputs``-th;
        by default, the outputs it holds), or None when it goes on."""
        p = req.params
        outputs = len(req.output_token_ids) if num_outputs is None else num_outputs
        if not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in p.stop_token_ids:
            return FinishReason.STOP
        if req.matcher is not None and req.matcher.done:  # its grammar allows nothing more
            # an object closed early to fit max_tokens was still cut by it
            return FinishReason.LENGTH if req.matcher.cut_by_budget else FinishReason.STOP
        if outputs >= p.max_tokens or req.num_prompt_tokens + outputs >= self.max_model_len:
            return FinishReason.LENGTH
        return None
