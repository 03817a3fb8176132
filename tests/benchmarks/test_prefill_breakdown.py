"""The prefill breakdown counts the work its wrappers see, and the peak it divides by."""

from __future__ import annotations

import torch

from benchmarks.peak import AMX_BF16, DPBF16, FMA32, FMA32_YMM, core_peak
from benchmarks.prefill_breakdown import CountedLinear, CountedPrefill
from benchmarks.step_breakdown import Clock
from shared.hardware import cpu_flags
from shared.model.attention import PrefillSegment
from shared.model.linear import TorchLinear
from shared.model.prefill_attention import SdpaPrefill
from tests.shared.kernels.compiler import needs_cc


@needs_cc
def test_peak_is_measured_on_the_unit_the_kernels_compute_with() -> None:
    fp32 = core_peak("float32", seconds=0.02)
    # GFLOP/s of one core: far above 1 on any CPU with vector FMA; zmm where it has AVX-512
    unit = FMA32 if "avx512f" in cpu_flags() else FMA32_YMM
    assert fp32 is None or (fp32.unit == unit.name and fp32.gflops_per_core > 1.0)
    bf16 = core_peak("bfloat16", seconds=0.02)
    if "amx_bf16" in cpu_flags():  # the bf16 GEMM and attention run on AMX tiles here
        assert bf16 is not None and bf16.unit == AMX_BF16.name
        assert fp32 is not None and bf16.gflops_per_core > 4 * fp32.gflops_per_core
    elif "avx512_bf16" in cpu_flags():
        assert bf16 is not None and bf16.unit == DPBF16.name
    if bf16 is not None:
        assert bf16.share(bf16.gflops_per_core, 2) == 0.5


@needs_cc
def test_a_peak_at_several_threads_is_each_cores_with_all_issuing_at_once() -> None:
    peak = core_peak("float32", seconds=0.02, threads=[1, 2])
    if peak is None:
        return
    assert set(peak.at_once) == {2} and peak.at_once[2] > 1.0
    # the share at 2 threads divides by the cores' rate measured together
    assert peak.share(2 * peak.at_once[2], 2) == 1.0
    assert "with 2 threads at once" in peak.describe()


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
