"""Our forward pass and KV cache against transformers' own loading of the same GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shared.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.model.registry import DEFAULT_MODEL, pull
from tests.conftest import CHAT_FRANCE
from tests.shared.model.forward import prefill_logits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_model(cache_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    gguf_path = pull(DEFAULT_MODEL, cache_dir, progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    return model.eval(), tok


def _prompt_64(loaded: LoadedModel) -> list[int]:
    text = (
        "The history of the Roman Empire spans centuries of conquest, engineering and law. "
        "Its roads, aqueducts and legions shaped Europe, and its language lives on in many "
        "modern tongues spoken from Lisbon to Bucharest, while scholars still debate the causes"
        " of its long decline and eventual fall in the west. Historians such as Gibbon wrote"
        " volumes about it."
    )
    ids = loaded.tokenizer.encode(text)
    assert len(ids) >= 64
    return ids[:64]


def test_logits_match_transformers(loaded_fp32: LoadedModel, hf_model: Any) -> None:
    model, _ = hf_model
    ids = _prompt_64(loaded_fp32)
    ours = prefill_logits(loaded_fp32, ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-3


def test_greedy_matches_transformers_generate(loaded_fp32: LoadedModel, hf_model: Any) -> None:
    model, _ = hf_model
    ids = _prompt_64(loaded_fp32)
    engine = Engine(loaded_fp32, EngineConfig())
    ours = engine.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32
        )[0, len(ids) :].tolist()
    assert ours.token_ids == ref


def test_tokenizer_and_chat_template_match_transformers(
    loaded_fp32: LoadedModel, hf_model: Any
) -> None:
    _, tok = hf_model
    texts = [
        "Hello 12345 world!  héllo 😀",
        "def f(x):\n    return x ** 2  # squares\n\n\n",
        "日本語のテキストと emoji 🚀🚀 and    spaces\tand tabs",
        "<|im_start|>user\nhi<|im_end|>",
        "Numbers: 3.14159, 1e-9, -42, 1,000,000",
    ]
    for text in texts:
        assert loaded_fp32.tokenizer.encode(text) == tok(text)["input_ids"], text
    ours = loaded_fp32.tokenizer.encode_chat(CHAT_FRANCE)
    ref = tok.apply_chat_template(CHAT_FRANCE, add_generation_prompt=True, tokenize=True)
    if not isinstance(ref, list):
        ref = ref["input_ids"]
    assert ours == list(ref)
