"""Gemma 3 (google/gemma-3-270m as a Q4_K_M GGUF, pulled from its PyPI chunk wheels)
against transformers' own loading of the same file, fp32: logits and greedy tokens
on prompts inside and past the 512-token sliding window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shared.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.model.arch import FULL, SLIDING
from shared.model.loader import LoadedModel, load_model
from shared.model.registry import GEMMA3_270M, pull
from tests.shared.model.forward import new_cache, prefill_logits

pytestmark = pytest.mark.slow

TEXTS = [
    "The history of the Roman Empire spans centuries of conquest, engineering and law.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Photosynthesis converts light energy into chemical energy. The process",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "The capital of France is",
    "Ünïcödé, 日本語のテキスト and emoji 🚀 in one sentence:",
]


@pytest.fixture(scope="module")
def gemma_gguf(cache_dir: Path) -> Path:
    return pull(GEMMA3_270M, cache_dir, progress=False)


@pytest.fixture(scope="module")
def gemma(gemma_gguf: Path, cache_dir: Path) -> LoadedModel:
    return load_model(GEMMA3_270M.name, cache_dir=cache_dir, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def hf_gemma(gemma_gguf: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma_gguf.parent), gguf_file=gemma_gguf.name, dtype=torch.float32
    )
    return model.eval()


def prompts(loaded: LoadedModel) -> list[list[int]]:
    """Eight prompts: six short ones, and two past the 512-token window (600 and 1,100
    tokens), so local layers drop the start of the context and global layers keep it."""
    tok = loaded.tokenizer
    short = [tok.encode(t) for t in TEXTS]
    story = " ".join(f"Chapter {i}: the travellers crossed river {i}." for i in range(250))
    long = tok.encode(story)
    assert len(long) > 1100
    return [*short, long[:600], long[:1100]]


def test_pull_joins_the_chunk_wheels_and_reads_gemma3(gemma: LoadedModel) -> None:
    a = gemma.arch
    assert (a.family, a.num_layers, a.hidden_size, a.sliding_window) == ("gemma3", 18, 640, 512)
    assert [i for i, t in enumerate(a.layer_types) if t == FULL] == [5, 11, 17]
    assert a.layer_types.count(SLIDING) == 15
    assert gemma.identity == f"gemma3-270m@sha256:{GEMMA3_270M.sha256}"
    assert gemma.tokenizer.encode_chat([{"role": "user", "content": "hi"}]) == (
        gemma.tokenizer.encode("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
    )
    assert 106 in gemma.tokenizer.eos_token_ids  # <end_of_turn> ends a reply


def test_logits_match_transformers_past_the_window(gemma: LoadedModel, hf_gemma: Any) -> None:
    ids = prompts(gemma)[-2]  # 600 tokens
    cache = new_cache(gemma, num_blocks=-(-len(ids) // 16) + 2)
    ours = prefill_logits(gemma, ids, cache=cache)
    with torch.no_grad():
        ref = hf_gemma(torch.tensor([ids])).logits[0].float()
    # fp32 sums in another order over a 262,144-word head: |logits| ~ 20, error ~ 1e-3
    assert (ours - ref).abs().max().item() < 1e-2
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # the test can fail: without the window, the rows past it are not the reference's
    windows = gemma.model.windows  # type: ignore[attr-defined]
    try:
        gemma.model.windows = (None,) * len(windows)  # type: ignore[attr-defined]
        unwindowed = prefill_logits(gemma, ids, cache=cache)
    finally:
        gemma.model.windows = windows  # type: ignore[attr-defined]
    assert (unwindowed[512:] - ref[512:]).abs().max().item() > 0.1
    assert torch.equal(unwindowed[:512], ours[:512])


def test_greedy_matches_transformers_generate(gemma: LoadedModel, hf_gemma: Any) -> None:
    """Eight prompts batched in one engine, 24 tokens each, against HF one at a time."""
    batch = prompts(gemma)
    engine = Engine(gemma, EngineConfig())
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ours = [out.token_ids for out in engine.generate(batch, params)]
    for ids, got in zip(batch, ours, strict=True):
        with torch.no_grad():
            ref = hf_gemma.generate(
                torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False
            )[0, len(ids) :].tolist()
        assert got == ref, len(ids)
