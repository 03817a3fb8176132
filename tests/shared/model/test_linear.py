"""Weight GEMM backends against plain F.linear, and how one is chosen."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.errors import ConfigError
from shared.model.linear import OneDNNLinear, TorchLinear, select_linear

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
    got = linear(x, linear.pack(weight))
    assert got.dtype == dtype and got.shape == (rows, 96)
    want = F.linear(x.double(), weight.double())
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("rows", [2, 3])
def test_torch_padding_keeps_the_rows(rows: int) -> None:
    x, weight = _operands(rows, torch.float32)
    padded = TorchLinear(pad_small_gemm=True)
    torch.testing.assert_close(padded(x, padded.pack(weight)), F.linear(x, weight))


def test_selection() -> None:
    assert select_linear("torch", torch.float32, "cpu").name == "torch"
    assert select_linear("auto", torch.float16, "cuda").name == "torch"
    with pytest.raises(ConfigError, match="CPU"):
        select_linear("onednn", torch.float16, "cuda")
    want = "onednn" if OneDNNLinear.probe(torch.float32) is None else "torch"
    assert select_linear("auto", torch.float32, "cpu").name == want


def test_unusable_onednn_is_a_clear_error_and_auto_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(OneDNNLinear, "probe", classmethod(lambda cls, dtype: "no oneDNN here"))
    with pytest.raises(ConfigError, match="no oneDNN here"):
        select_linear("onednn", torch.float32, "cpu")
    fallback = select_linear("auto", torch.float32, "cpu")
    assert isinstance(fallback, TorchLinear) and fallback.pad_small_gemm
