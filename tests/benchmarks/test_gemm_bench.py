"""The GEMM benchmark times two backends doing the same products."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gemm_bench import LAYER_SHAPES, LM_HEAD, activations, forward_flops, forward_weights
from shared.config import default_cache_dir
from shared.model.linear import NativeLinear, OneDNNLinear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_sides_compute_the_same_products(dtype: torch.dtype) -> None:
    native = NativeLinear.load(dtype, default_cache_dir() / "kernels")
    if isinstance(native, str):
        pytest.skip(native)
    if OneDNNLinear.probe(dtype) is not None:
        pytest.skip("oneDNN linear is unavailable here")
    onednn = OneDNNLinear()
    ours, theirs = forward_weights(native, dtype, 1), forward_weights(onednn, dtype, 1)
    shapes = [*LAYER_SHAPES.values(), LM_HEAD]
    assert [(w.out_features, w.in_features) for w in ours] == shapes
    xs = activations(ours, 5, dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(ours, theirs, strict=True):
        x = xs[a.in_features]
        torch.testing.assert_close(native(x, a).float(), onednn(x, b).float(), atol=tol, rtol=tol)


def test_flops_count_every_weight_once_per_row() -> None:
    weights = sum(n * k for n, k in LAYER_SHAPES.values()) * 30 + LM_HEAD[0] * LM_HEAD[1]
    assert forward_flops(32, 30) == 2 * 32 * weights
