"""Disaggregation inside one process: a prefill engine's KV, copied out layer by layer
through the model's layer hook, lets a second engine decode the same tokens as one
engine doing both (the services do the same through the KV store)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.request import SampledToken
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import SchedulerOutput
from tests.conftest import EngineFactory


def prefill_then_decode(
    prefiller: Engine, decoder: Engine, prompt: list[int], params: SamplingParams, seed: int
) -> tuple[list[int], list[int]]:
    """Returns (generated tokens, layers seen by the hook, in order)."""
    layers_seen: list[int] = []
    bs = prefiller.layout.block_size
    n_blocks = -(-len(prompt) // bs)
    staged = torch.zeros((n_blocks, *prefiller.layout.block_shape), dtype=torch.float32)

    def hook(layer: int, step: SchedulerOutput) -> None:
        layers_seen.append(layer)
        for s in step.scheduled:
            for i, b in enumerate(s.request.block_ids[:n_blocks]):
                staged[i, layer] = prefiller.kv_cache.pool[b, layer]  # final for this layer

    prefill_params = SamplingParams(
        max_tokens=1, temperature=params.temperature, top_p=params.top_p, seed=seed
    )
    rid = prefiller.add_request(prompt, prefill_params, detokenize=False)
    outs = []
    while prefiller.has_unfinished():
        outs += prefiller.step(on_layer=hook)
    first = next(o for o in outs if o.request_id == rid).new_token_ids[0]

    blocks = decoder.reserve_blocks(-(-(len(prompt) + 1) // bs))
    assert blocks is not None
    for i in range(n_blocks):
        decoder.kv_cache.pool[blocks[i]] = staged[i]
    decoder.add_prefilled(prompt, params, SampledToken(first), blocks, request_id="d1", seed=seed)
    tokens = [first]
    while decoder.has_unfinished():
        for out in decoder.step():
            tokens += out.new_token_ids
    return tokens, layers_seen


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_handoff_gives_the_same_tokens_as_one_engine(
    make_engine: EngineFactory, temperature: float
) -> None:
    prompt = make_engine().tokenizer.encode("The river ran past the old mill and " * 5)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=7, ignore_eos=True)
    reference = make_engine().generate([prompt], params)[0].token_ids
    # a chunked prefill (budget 32) exercises blocks completing across steps
    prefiller = make_engine(max_num_batched_tokens=32)
    decoder = make_engine()
    tokens, layers = prefill_then_decode(prefiller, decoder, prompt, params, seed=7)
    assert tokens == reference
    n_layers = prefiller.layout.num_layers
    assert layers[:n_layers] == list(range(n_layers))
    assert decoder.block_pool.num_free == decoder.block_pool.num_blocks


def test_reserve_blocks_keeps_growth_room_for_running_requests(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(kv_cache_bytes=20 * 737_280)  # 20 blocks
    held = engine.reserve_blocks(19)
    assert held is not None
    assert engine.reserve_blocks(2) is None  # admission waits instead of failing
    engine.free_blocks(held)
    assert engine.block_pool.num_free == 20
