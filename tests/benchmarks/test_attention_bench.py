"""The attention benchmark times two implementations of the same computation."""

from __future__ import annotations

import pytest
import torch

from benchmarks.attention_bench import HEAD_DIM, make_inputs
from shared.config import default_cache_dir
from shared.kernels.paged_prefill import PagedPrefillKernel
from shared.model.prefill_attention import NativePrefill, SdpaPrefill
from tests.shared.kernels.compiler import needs_cc


@needs_cc
@pytest.mark.parametrize(("new", "context"), [(64, 64), (32, 100)])
def test_both_sides_compute_the_same_attention(new: int, context: int) -> None:
    kernel = PagedPrefillKernel.build(default_cache_dir() / "kernels")
    inputs = make_inputs(new, context, torch.float32)
    _, k_new, v_new, k_pool, v_pool, seg = inputs
    # the "new" rows handed to SDPA are the context's last rows in the pools
    for new_rows, pool in ((k_new, k_pool), (v_new, v_pool)):
        context_rows = pool[seg.block_table].reshape(-1, 3, HEAD_DIM)[:context]
        assert torch.equal(context_rows[-new:], new_rows)
    torch.testing.assert_close(
        NativePrefill(kernel)(*inputs, HEAD_DIM**-0.5),
        SdpaPrefill()(*inputs, HEAD_DIM**-0.5),
        atol=1e-5,
        rtol=1e-5,
    )
