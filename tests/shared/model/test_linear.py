"""Weight GEMM backends against plain F.linear, and how one is chosen. (The
native kernel's own tests are in tests/shared/kernels/test_gemm.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.config import default_cache_dir
from shared.errors import ConfigError
from shared.model.linear import NativeLinear, OneDNNLinear, TorchLinear, select_linear
from tests.shared.kernels.compiler import has_compiler

KDIR = default_cache_dir() / "kernels"

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # atol = rtol


def _operands(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    return torch.randn(rows, 64, generator=gen).to(dtype), weight


def _onednn_or_skip(dtype: torch.dtype) -> OneDNNLinear:
    problem = OneDNNLinear.probe(dtype)
    if problem is not None:
        pytest.skip(problem)
    return OneDNNLinear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64, 301])
def test_onednn_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    linear = _onednn_or_skip(dtype)
    x, weight = _operands(rows, dtype)
    packed = linear.pack(weight)
    assert (packed.out_features, packed.in_features) == (96, 64)
    got = linear(x, packed)
    assert got.dtype == dtype and got.shape == (rows, 96)
    want = F.linear(x.double(), weight.double())
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("rows", [2, 3])
def test_torch_padding_keeps_the_rows(rows: int) -> None:
    x, weight = _operands(rows, torch.float32)
    padded = TorchLinear(pad_small_gemm=True)
    torch.testing.assert_close(padded(x, padded.pack(weight)), F.linear(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_native_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    linear = NativeLinear.load(dtype, KDIR)
    if isinstance(linear, str):
        pytest.skip(linear)
    x, weight = _operands(rows, dtype)
    got = linear(x, linear.pack(weight))
    assert got.dtype == dtype and got.shape == (rows, 96)
    want = F.linear(x.double(), weight.double())
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_selection() -> None:
    assert select_linear("torch", torch.float32, "cpu", KDIR).name == "torch"
    assert select_linear("auto", torch.float16, "cuda", KDIR).name == "torch"
    for backend in ("onednn", "native"):
        with pytest.raises(ConfigError, match="CPU"):
            select_linear(backend, torch.float16, "cuda", KDIR)
    with pytest.raises(ConfigError, match="fp32 and bf16, not torch"):
        select_linear("native", torch.float16, "cpu", KDIR)
    flags = set(_cpu_flags().split())
    # the native kernel builds for a dtype wherever the CPU has one of these flag sets
    needs = {torch.float32: [{"avx512f"}, {"avx2", "fma"}], torch.bfloat16: [{"avx512_bf16"}]}
    for dtype, sets in needs.items():
        loaded = NativeLinear.load(dtype, KDIR)
        native = isinstance(loaded, NativeLinear)
        assert native or not has_compiler() or not any(s <= flags for s in sets)
        assert not native or select_linear("native", dtype, "cpu", KDIR).name == "native"
        onednn = OneDNNLinear.probe(dtype) is None
        # auto passes over the AVX2 fp32 form for oneDNN (its prompts are slower)
        preferred = isinstance(loaded, NativeLinear) and loaded.preferred(dtype)
        want = "native" if preferred or (native and not onednn) else "onednn" if onednn else "torch"
        assert select_linear("auto", dtype, "cpu", KDIR).name == want


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def test_unusable_backends_are_clear_errors_and_auto_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(NativeLinear, "load", classmethod(lambda cls, dtype, kdir: "no kernel"))
    with pytest.raises(ConfigError, match="no kernel"):
        select_linear("native", torch.float32, "cpu", KDIR)
    want = "onednn" if OneDNNLinear.probe(torch.float32) is None else "torch"
    assert select_linear("auto", torch.float32, "cpu", KDIR).name == want
    monkeypatch.setattr(OneDNNLinear, "probe", classmethod(lambda cls, dtype: "no oneDNN here"))
    with pytest.raises(ConfigError, match="no oneDNN here"):
        select_linear("onednn", torch.float32, "cpu", KDIR)
    fallback = select_linear("auto", torch.float32, "cpu", KDIR)
    assert isinstance(fallback, TorchLinear) and fallback.pad_small_gemm
