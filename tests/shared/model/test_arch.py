"""Reading architectures from HF configs (pure): Gemma 3 as transformers 4 and 5 write
it, the round trip through the converter's config, and what is refused."""

from __future__ import annotations

from typing import Any

import pytest

from shared.errors import ModelFormatError, UnsupportedModelError
from shared.model.arch import FULL, SLIDING, ModelArch

GEMMA3_V5: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "rope_parameters": {
        FULL: {"rope_type": "default", "rope_theta": 1_000_000.0},
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    },
}
# what google/gemma-3-270m's config.json says under transformers 4
GEMMA3_V4 = {k: v for k, v in GEMMA3_V5.items() if k != "rope_parameters"} | {
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "sliding_window_pattern": 6,
}


@pytest.mark.parametrize("cfg", [GEMMA3_V5, GEMMA3_V4], ids=["transformers5", "transformers4"])
def test_gemma3_configs_of_both_spellings_read_alike(cfg: dict[str, Any]) -> None:
    a = ModelArch.from_hf_config(cfg)
    assert (a.family, a.rope_theta, a.rope_local_theta) == ("gemma3", 1e6, 1e4)
    assert [a.window(i) for i in range(6)] == [512] * 5 + [None]
    assert a.layer_types.count(FULL) == 3 and a.attention_scale == 256**-0.5
    assert a.tie_word_embeddings and a.hidden_act == "gelu_pytorch_tanh"
    assert ModelArch.from_hf_config(a.to_hf_config()) == a
    assert isinstance(a.to_hf_config()["query_pre_attn_scalar"], int)  # transformers is strict


def test_llama_layers_have_no_window() -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
    }  # fmt: skip
    a = ModelArch.from_hf_config(cfg)
    assert a.family == "llama" and a.window(0) is None and a.attention_scale == 4**-0.5


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"final_logit_softcapping": 30.0}, UnsupportedModelError, "softcapping"),
        ({"hidden_activation": "gelu"}, UnsupportedModelError, "activation"),
        ({"layer_types": [FULL] * 3}, ModelFormatError, "layer_types"),
        ({"num_key_value_heads": 3}, ModelFormatError, "multiple"),
        ({"hidden_size": "wide"}, ModelFormatError, "bad field"),
    ],
)
def test_gemma3_configs_baton_cannot_run_are_refused(
    change: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ModelArch.from_hf_config(GEMMA3_V5 | change)
