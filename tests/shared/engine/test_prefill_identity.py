"""Prefill identities on the real model, bitwise, in each dtype: the rows a prompt's
prefill computes do not depend on how it is chunked, and a weight GEMM's row does
not depend on the rows computed beside it. Chunking follows the batch (a prompt
alone takes larger chunks than one with others queued), so both must hold for
every path to give the same tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from shared.model.linear import PackedWeight
from shared.model.loader import LoadedModel, load_model
from tests.shared.model.forward import new_cache, prefill_logits

PROMPT_TOKENS = 300


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def loaded(request: pytest.FixtureRequest, cache_dir: Path) -> LoadedModel:
    return load_model(None, cache_dir=cache_dir, dtype=request.param, progress=False)


def prompt(loaded: LoadedModel) -> list[int]:
    rng = random.Random(30)
    return [rng.randrange(100, loaded.arch.vocab_size - 100) for _ in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def one_pass(loaded: LoadedModel) -> torch.Tensor:
    """Every row's logits of the prompt prefilled in one pass."""
    return prefill_logits(loaded, prompt(loaded))


@pytest.mark.parametrize("chunk", [1, 13, 16, 64, 256, 1024])
def test_a_prompt_prefilled_in_one_pass_equals_it_prefilled_in_chunks(
    loaded: LoadedModel, one_pass: torch.Tensor, chunk: int
) -> None:
    """Chunks of any size, aligned to the KV blocks or not, each on top of the KV the
    previous ones wrote: every row's logits bitwise those of the one-pass prefill."""
    ids = prompt(loaded)
    whole = one_pass
    cache = new_cache(loaded)
    pieces = [
        prefill_logits(loaded, ids[: start + chunk], start=start, cache=cache)
        for start in range(0, len(ids), chunk)
    ]
    assert torch.equal(torch.cat(pieces), whole)


@pytest.mark.parametrize("length", [1, 16, 17, PROMPT_TOKENS])
def test_a_last_layer_of_the_sampled_row_only_gives_its_logits_bitwise(
    loaded: LoadedModel, one_pass: torch.Tensor, length: int
) -> None:
    """A step that samples a prompt computes its last layer past the K/V writes for the
    sampled row alone (as a decode row): that row's logits are bitwise those of the
    prefill computing every row, at the first token, a block's last and first slots and
    a long prompt; so is a later chunk's, on top of the KV an earlier chunk wrote that
    sampled no row (its last layer computes none past the K/V writes)."""
    ids = prompt(loaded)[:length]
    whole = one_pass if length == PROMPT_TOKENS else prefill_logits(loaded, ids)
    assert torch.equal(prefill_logits(loaded, ids, last_only=True)[0], whole[-1])
    if length > 1:  # the first chunk samples nothing: its last layer stops at the K/V
        cache = new_cache(loaded)
        assert prefill_logits(loaded, ids[: length // 2], cache=cache, none=True).shape[0] == 0
        tail = prefill_logits(loaded, ids, start=length // 2, cache=cache, last_only=True)
        assert torch.equal(tail[0], whole[-1])


def test_a_row_alone_equals_the_same_row_among_512(loaded: LoadedModel) -> None:
    """Every weight shape of the model (fused QKV, O, fused gate/up with its activation,
    down, the head), through the GEMM the engine picked: a row computed at M = 1, and
    inside M = 64, equals the same row inside M = 512."""
    model = loaded.model
    layer = model.layers[0]
    weights = {
        "qkv": layer.qkv,
        "o_proj": layer.o_proj,
        "gate_up": layer.gate_up,
        "down": layer.down,
        "lm_head": model.lm_head,
    }
    g = torch.Generator().manual_seed(5)
    for name, packed in weights.items():

        def gemm(x: torch.Tensor, packed: PackedWeight = packed, name: str = name) -> torch.Tensor:
            if name == "gate_up":
                return model.gemm.glu(x, packed, "silu", model.ops)
            return model.gemm(x, packed)

        x = torch.randn(512, packed.in_features, generator=g).to(model.dtype)
        full = gemm(x)
        for row in (0, 1, 255, 511):
            alone = gemm(x[row : row + 1].contiguous())
            assert torch.equal(alone[0], full[row]), (name, row)
        assert torch.equal(gemm(x[200:264].contiguous()), full[200:264]), name
