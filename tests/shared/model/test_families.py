"""The family registry (pure): a checkpoint's architecture name maps to the family that
serves it; anything else, and a tensor type the converter cannot read, is refused in
one line that names it and lists what Baton serves."""

from __future__ import annotations

import pytest

from shared.errors import UnsupportedModelError
from shared.model import families


def test_checkpoints_map_to_their_family() -> None:
    assert families.for_gguf("llama") is families.LLAMA
    assert families.for_hf({"architectures": ["MistralForCausalLM"]}) is families.LLAMA
    assert families.for_hf({"model_type": "llama"}) is families.LLAMA
    assert families.for_gguf("gemma3") is families.GEMMA3
    assert families.for_hf({"architectures": ["Gemma3ForCausalLM"]}) is families.GEMMA3
    assert families.for_hf({"model_type": "gemma3_text"}) is families.GEMMA3


def test_every_family_has_an_implementation() -> None:
    from shared.model.loader import IMPLEMENTATIONS

    for family in families.FAMILIES:
        pack, model = IMPLEMENTATIONS[family.name]
        assert pack.__module__ == model.__module__ == family.implementation


@pytest.mark.parametrize(
    "lookup",
    [
        lambda: families.for_gguf("qwen2"),
        lambda: families.for_hf({"architectures": ["Qwen2ForCausalLM"]}),
        lambda: families.for_hf({"model_type": "qwen2"}),
    ],
)
def test_anything_else_is_refused_naming_it_and_listing_the_served(lookup: object) -> None:
    with pytest.raises(UnsupportedModelError) as err:
        lookup()  # type: ignore[operator]
    line = str(err.value)
    assert "\n" not in line and "qwen2" in line.lower()
    assert "llama (llama, LlamaForCausalLM, MistralForCausalLM)" in line
    assert "gemma3 (gemma3, Gemma3ForCausalLM)" in line


def test_tensor_types_outside_the_list_are_refused_by_tensor() -> None:
    families.check_gguf_types([("a", "Q4_K"), ("b", "F32"), ("c", "Q8_0")])
    refused = r"tensor blk.3.ffn_up.weight: GGUF type IQ2_XS"
    with pytest.raises(UnsupportedModelError, match=refused):
        families.check_gguf_types([("a", "Q4_K"), ("blk.3.ffn_up.weight", "IQ2_XS")])


def test_the_table_lists_every_family_with_its_quantizations() -> None:
    rows = families.table()
    assert [r["family"] for r in rows] == [f.name for f in families.FAMILIES]
    assert all("Q4_K" in r["quantizations (GGUF)"] for r in rows)
