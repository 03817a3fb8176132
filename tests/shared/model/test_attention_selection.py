"""Which attention kernels a model with sliding-window layers gets (pure selection
logic; the Triton probe is replaced by a named fake that says Triton runs here)."""

from __future__ import annotations

import pytest
import torch

from shared.config import default_cache_dir
from shared.errors import ConfigError
from shared.model import decode_attention, prefill_attention
from shared.model.attention_impl import select_attention
from shared.model.decode_attention import GatherDecode
from shared.model.prefill_attention import SdpaPrefill


def fake_triton_runs(*_: object) -> None:
    """Fake probe: no problem, Triton would run on this device."""
    return None


@pytest.fixture
def triton_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_attention, "triton_attention_problem", fake_triton_runs)
    monkeypatch.setattr(prefill_attention, "triton_attention_problem", fake_triton_runs)


def test_a_windowed_model_on_cuda_gets_the_torch_paths_not_triton(triton_runs: None) -> None:
    kdir = default_cache_dir() / "kernels"
    impl = select_attention("auto", torch.bfloat16, 256, "cuda", kdir, windowed=True)
    assert isinstance(impl.decode, GatherDecode) and isinstance(impl.prefill, SdpaPrefill)


def test_asking_for_triton_with_a_window_is_a_clear_error(triton_runs: None) -> None:
    kdir = default_cache_dir() / "kernels"
    with pytest.raises(ConfigError, match="sliding window"):
        select_attention("triton", torch.bfloat16, 256, "cuda", kdir, windowed=True)
