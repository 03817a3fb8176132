"""RoPE frequencies, including ``rope_scaling``, against transformers' own implementation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shared.model.arch import ModelArch
from shared.model.rope import Rope, inv_frequencies

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 1,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rope_theta": 100000.0,
    "max_position_embeddings": 32768,
}
SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_inv_frequencies_match_transformers(scaling: dict[str, Any] | None) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = BASE | ({"rope_scaling": scaling} if scaling else {})
    ours = inv_frequencies(ModelArch.from_hf_config(cfg)).float()
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    kind = scaling["rope_type"] if scaling else None
    if kind is None:
        ref = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, 64, 2).float() / 64))
    else:
        ref, factor = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
        assert factor == 1.0
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


def test_rotation_preserves_norm_and_relative_angles() -> None:
    arch = ModelArch.from_hf_config(BASE)
    rope = Rope(arch, torch.float32, "cpu")
    q = torch.randn(1, 1, 64)
    k = torch.randn(1, 1, 64)

    def dot(i: int, j: int) -> float:
        ci, si = rope.at(torch.tensor([i]))
        cj, sj = rope.at(torch.tensor([j]))
        return float((Rope.apply(q, ci, si) * Rope.apply(k, cj, sj)).sum())

    c, s = rope.at(torch.tensor([7]))
    assert torch.allclose(Rope.apply(q, c, s).norm(), q.norm(), atol=1e-5)
    assert dot(10, 3) == pytest.approx(dot(107, 100), abs=1e-4)  # depends on i - j only
