"""Next-token masks of constrained requests, computed beside the forward pass.

A mask costs llguidance ~20 us to over a millisecond (a request's first visit to a
grammar state is the dear one) and the forward pass does not need it, so
:class:`MaskWorker` computes a step's masks on a thread of its own while the engine
thread runs the model (llguidance releases the GIL; the worker uses numpy only, so
it starts no OpenMP team of its own), and sampling finds them ready.

Ownership: from :meth:`MaskWorker.start` until its future is done the worker reads
the step's matchers; the engine thread advances a matcher only after sampling, and
sampling waits for the future first.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from shared.engine.grammar import Matcher
    from shared.engine.request import RequestId


def allowed_token_ids(matchers: Sequence[Matcher]) -> list[torch.Tensor]:
    """For each matcher, the token ids its grammar allows next (int64, ascending)."""
    if not matchers:
        return []
    bits = np.zeros((len(matchers), matchers[0].mask_words), dtype=np.uint32)
    for row, m in zip(bits, matchers, strict=True):
        m.fill_mask(row)
    # token t is bit t % 32 of word t // 32: little-endian bytes, little-endian bits
    unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
    return [torch.from_numpy(np.flatnonzero(row)) for row in unpacked]


class MaskWorker:
    """One thread that computes masks for the engine thread (one step at a time)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="baton-grammar")

    def start(
        self, matchers: dict[RequestId, Matcher]
    ) -> Future[dict[RequestId, torch.Tensor]] | None:
        """Begin the masks of ``matchers`` (the step's constrained rows that sample);
        None when there are none."""
        if not matchers:
            return None
        return self._pool.submit(self._compute, dict(matchers))

    def _compute(self, matchers: dict[RequestId, Matcher]) -> dict[RequestId, torch.Tensor]:
        ids = allowed_token_ids(list(matchers.values()))
        return dict(zip(matchers, ids, strict=True))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
