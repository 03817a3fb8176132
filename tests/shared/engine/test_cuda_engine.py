"""The engine on a CUDA device (skipped without one): the default model's answer, and the
GPU guarantee: a request's tokens and logprobs are bitwise the same alone or in a batch,
and a prefill over tokens decode computed continues exactly as decode did (what caching
and failover rely on)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shared.config import CacheConfig, DType, EngineConfig
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.kernels.triton_support import triton_problem
from shared.model.loader import LoadedModel, load_model
from tests.conftest import CHAT_FRANCE

pytestmark = pytest.mark.skipif(
    triton_problem("cuda") is not None, reason=f"needs CUDA and Triton: {triton_problem('cuda')}"
)


def cuda_engine(loaded: LoadedModel, *, caching: bool = False) -> Engine:
    cache = CacheConfig(kv_cache_bytes=256 << 20, enable_prefix_caching=caching, prefault=False)
    return Engine(loaded, EngineConfig(dtype=_dtype(loaded), device="cuda", cache=cache))


def _dtype(loaded: LoadedModel) -> DType:
    return "bfloat16" if loaded.model.dtype is torch.bfloat16 else "float32"


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def loaded_cuda(request: pytest.FixtureRequest, cache_dir: Path) -> LoadedModel:
    return load_model(None, cache_dir=cache_dir, dtype=request.param, device="cuda", progress=False)


def test_cuda_engine_picks_the_invariant_kernels_and_answers(loaded_cuda: LoadedModel) -> None:
    engine = cuda_engine(loaded_cuda)
    assert loaded_cuda.model.gemm.name == "triton"
    assert loaded_cuda.model.ops.name == "triton"
    assert engine.runner.attention.decode.name == "triton"
    assert engine.runner.attention.prefill.name == "triton"
    prompt = engine.tokenizer.encode_chat(CHAT_FRANCE)
    done = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    if loaded_cuda.model.dtype is torch.float32:
        assert done.text == "The capital of France is Paris."
    # bf16: "The" leads "L" by 0.08 in fp32 logits, under bf16's 0.125 step at 25, so
    # bf16 kernels (ours and transformers' alike) may start the answer either way


def _prompts(engine: Engine) -> list[list[int]]:
    text = "The history of the Roman Empire spans centuries of conquest, engineering and law. "
    base = engine.tokenizer.encode(text * 12)
    return [base[: 37 + 29 * i] for i in range(8)]


def test_tokens_and_logprobs_do_not_depend_on_the_batch(loaded_cuda: LoadedModel) -> None:
    engine = cuda_engine(loaded_cuda)
    prompts = _prompts(engine)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    alone = [engine.generate([p], params)[0] for p in prompts]
    together = engine.generate(prompts, params)
    for a, b in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]


def test_prefill_over_decoded_tokens_continues_bitwise(loaded_cuda: LoadedModel) -> None:
    """Failover and answer caching recompute (or load) in one prefill what decode
    computed a token at a time; the continuation must not change by a bit."""
    engine = cuda_engine(loaded_cuda)
    prompt = _prompts(engine)[3]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)
    first = engine.generate([prompt], params)[0]
    for cut in (5, 17, 32):
        resumed = engine.generate(
            [prompt + first.token_ids[:cut]],
            SamplingParams(max_tokens=40 - cut, temperature=0, ignore_eos=True, logprobs=0),
        )[0]
        assert resumed.token_ids == first.token_ids[cut:]
        assert [x.logprob for x in resumed.logprobs] == [x.logprob for x in first.logprobs[cut:]]


def test_decode_graphs_replay_the_eager_bits(loaded_cuda: LoadedModel) -> None:
    """Decode steps replayed from CUDA graphs (batches padded to a bucket) give the tokens
    and logprobs eager steps give, and they are replayed."""
    cache = CacheConfig(kv_cache_bytes=256 << 20, enable_prefix_caching=False, prefault=False)
    config = EngineConfig(dtype=_dtype(loaded_cuda), device="cuda", cache=cache)
    graphed = Engine(loaded_cuda, config)
    eager = Engine(loaded_cuda, replace(config, cuda_graphs=False))
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    prompts = _prompts(graphed)[:5]  # 5 rows: padded to the bucket of 8
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0)
    a, b = graphed.generate(prompts, params), eager.generate(prompts, params)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert [p.logprob for p in x.logprobs] == [p.logprob for p in y.logprobs]
    assert 8 in graphed.runner.graphs.captured
