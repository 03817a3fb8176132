"""The prefill breakdown counts the work its wrappers see, and the peak it divides by."""

from __future__ import annotations

import torch

from benchmarks.peak import peak_gflops
from benchmarks.prefill_breakdown import CountedLinear, CountedPrefill
from benchmarks.step_breakdown import Clock
from shared.model.attention import PrefillSegment
from shared.model.linear import TorchLinear
from shared.model.prefill_attention import SdpaPrefill
from tests.shared.kernels.compiler import needs_cc


@needs_cc
def test_peak_is_measured_where_the_cpu_has_the_instruction() -> None:
    fp32 = peak_gflops("float32", seconds=0.02)
    assert fp32 is None or fp32 > 1.0  # GFLOP/s of one core: far above 1 on any AVX-512 CPU


def test_gemm_flops_come_from_the_shapes_run() -> None:
    clock = Clock()
    gemm = CountedLinear(TorchLinear(pad_small_gemm=False), clock)
    packed = gemm.pack(torch.randn(6, 4))
    out = gemm(torch.randn(5, 4), packed)
    assert out.shape == (5, 6)
    assert gemm.flops == 2 * 5 * 4 * 6
    assert clock.spent["gemm"] > 0


def test_attention_flops_count_the_causal_pairs_over_the_cached_prefix() -> None:
    clock = Clock()
    attn = CountedPrefill(SdpaPrefill(), clock)
    heads, kv_heads, d, block = 4, 2, 8, 4
    new, context = 3, 5  # 2 cached tokens: rows see 3, 4 and 5 keys
    pool = torch.randn(2, block, kv_heads, d)
    table = torch.tensor([0, 1])
    seg = PrefillSegment(start=0, end=new, block_table=table, context_len=context)
    q = torch.randn(new, heads, d)
    ctx = pool[table].reshape(-1, kv_heads, d)[:context]
    attn(q, ctx[-new:], ctx[-new:], pool, pool, seg, d**-0.5)
    assert attn.flops == 4.0 * heads * d * (3 + 4 + 5)
