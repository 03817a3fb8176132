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


@needs_cc
def test_decode_inputs_are_what_the_kernel_and_the_gathered_context_agree_on() -> None:
    """The decode cases: every sequence's table covers its context, blocks distinct."""
    from benchmarks.attention_bench import make_decode_inputs
    from shared.kernels.paged_decode import PagedDecodeKernel

    q, k_pool, v_pool, batch = make_decode_inputs(3, 40, torch.float32)
    used = batch.tables[:, :3].flatten()
    assert len(set(used.tolist())) == used.numel()
    kernel = PagedDecodeKernel.build(default_cache_dir() / "kernels")
    out = torch.empty_like(q)
    kernel(q, k_pool, v_pool, batch.tables, batch.lens, HEAD_DIM**-0.5, out)
    keys = k_pool[batch.tables[0, :3]].reshape(-1, 3, HEAD_DIM)[:40].transpose(0, 1)
    values = v_pool[batch.tables[0, :3]].reshape(-1, 3, HEAD_DIM)[:40].transpose(0, 1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[0][:, None], keys.repeat_interleave(3, 0), values.repeat_interleave(3, 0),
        scale=HEAD_DIM**-0.5,
    )[:, 0]  # fmt: skip
    torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)
