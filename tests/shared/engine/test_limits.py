"""RequestLimits: what an engine refuses up front, and when a request stops."""

from __future__ import annotations

import pytest

from shared.engine.limits import RequestLimits
from shared.engine.request import FinishReason, Request, RequestId
from shared.engine.sampling_params import SamplingParams
from shared.errors import InvalidRequestError, RequestTooLongError

LIMITS = RequestLimits(max_model_len=64, block_size=4, num_slots=10, eos_token_ids=(2,))


def request(n_prompt: int, params: SamplingParams) -> Request:
    return Request(
        request_id=RequestId("r"),
        prompt_token_ids=list(range(10, 10 + n_prompt)),
        params=params,
        seed=0,
        arrival=0.0,
    )


def test_a_request_that_can_never_run_is_refused_with_the_reason() -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        LIMITS.check_fits(0, 4)
    with pytest.raises(RequestTooLongError, match="exceeds the context length 64"):
        LIMITS.check_fits(60, 5)
    with pytest.raises(RequestTooLongError, match="more KV blocks"):
        LIMITS.check_fits(30, 11)  # 41 tokens: 11 blocks of 4, the pool has 10
    LIMITS.check_fits(30, 10)  # 40 tokens: exactly the pool


def test_stop_reasons() -> None:
    r = request(8, SamplingParams(max_tokens=3))
    assert LIMITS.stop_reason(r, 2, num_outputs=1) is FinishReason.STOP  # EOS
    assert LIMITS.stop_reason(r, 7, num_outputs=2) is None
    assert LIMITS.stop_reason(r, 7, num_outputs=3) is FinishReason.LENGTH
    ignoring = request(8, SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=(9,)))
    assert LIMITS.stop_reason(ignoring, 2, num_outputs=1) is None
    assert LIMITS.stop_reason(ignoring, 9, num_outputs=1) is FinishReason.STOP
    long = request(60, SamplingParams(max_tokens=100))
    assert LIMITS.stop_reason(long, 7, num_outputs=3) is None
    assert LIMITS.stop_reason(long, 7, num_outputs=4) is FinishReason.LENGTH  # context full
