"""The in-process engine on the real default model: batching, caching, chunking, sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.config import (
    CacheConfig,
    EngineConfig,
    LinearBackend,
    PreemptionSetting,
    SchedulerConfig,
)
from shared.engine.engine import Engine
from shared.engine.outputs import Completion
from shared.engine.request import FinishReason
from shared.engine.sampling_params import SamplingParams
from shared.errors import InvalidRequestError, KernelBuildError, RequestTooLongError
from shared.kernels.build import find_compiler
from shared.model.linear import OneDNNLinear
from shared.model.loader import LoadedModel, load_model
from tests.conftest import CHAT_FRANCE, EngineFactory
from tests.shared.model.forward import new_cache, prefill_logits

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(loaded: LoadedModel) -> list[list[int]]:
    texts = [
        "Hi",
        "The quick brown fox",
        "Write a haiku about the sea.",
        "List three prime numbers and explain why each one is prime, briefly.",
        "In 1969, astronauts landed on the Moon. Describe the mission in detail, including "
        "the crew, the spacecraft, the landing site and what they brought back to Earth.",
        "Python is a programming language. " * 7,
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    ',
        "Once upon a time, in a kingdom far away, there lived a princess who " * 3,
    ]
    return [loaded.tokenizer.encode(t) for t in texts]


def assert_same_generations(got: list[Completion], want: list[Completion]) -> None:
    """Same greedy tokens, and logprobs equal to fp32 rounding."""
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want, strict=True):
        assert len(g.logprobs) == len(w.logprobs) == len(g.token_ids)
        torch.testing.assert_close(
            torch.tensor([lp.logprob for lp in g.logprobs]),
            torch.tensor([lp.logprob for lp in w.logprobs]),
            atol=1e-4,
            rtol=0,
        )


def test_chat_answers_paris(make_engine: EngineFactory) -> None:
    engine = make_engine()
    ids = engine.tokenizer.encode_chat(CHAT_FRANCE)
    out = engine.generate([ids], SamplingParams(max_tokens=32, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason is FinishReason.STOP
    assert out.text == engine.tokenizer.decode(out.token_ids)


def test_ragged_batch_matches_running_alone(
    make_engine: EngineFactory, loaded_fp32: LoadedModel
) -> None:
    prompts = _prompts(loaded_fp32)
    assert len({len(p) for p in prompts}) == len(prompts)
    alone = [make_engine().generate([p], GREEDY)[0].token_ids for p in prompts]
    batched = make_engine().generate(prompts, GREEDY)
    assert [b.token_ids for b in batched] == alone


def test_attention_backends_agree(make_engine: EngineFactory, loaded_fp32: LoadedModel) -> None:
    """The native kernels (decode, and prefill where the CPU has AVX-512) and the
    pure-torch paths give the same greedy tokens and logprobs (to fp32 rounding)
    on a ragged batch."""
    try:
        find_compiler()
    except KernelBuildError:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    prompts = _prompts(loaded_fp32)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    native_engine = make_engine(attention="auto")
    # prefill is native too where the CPU has AVX-512, else SDPA on both sides
    assert native_engine.runner.attention.decode.name == "native"
    native = native_engine.generate(prompts, params)
    plain = make_engine(attention="torch").generate(prompts, params)
    assert_same_generations(native, plain)


@pytest.mark.parametrize("backend", ["onednn", "torch"])
def test_linear_backends_agree(
    make_engine: EngineFactory, loaded_fp32: LoadedModel, cache_dir: Path, backend: LinearBackend
) -> None:
    """The default GEMM (the native kernel where it builds), oneDNN on prepacked
    weights and F.linear (with its small-GEMM padding: 2-3 row batches occur
    here) give the same greedy tokens and logprobs."""
    if backend == "onednn" and OneDNNLinear.probe(torch.float32) is not None:
        pytest.skip("oneDNN linear is unavailable on this torch build or CPU")
    if loaded_fp32.model.gemm.name == backend:
        pytest.skip(f"{backend} is the default here; nothing to compare it with")
    prompts = _prompts(loaded_fp32)[:3]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    default = make_engine().generate(prompts, params)
    other = load_model(None, cache_dir=cache_dir, linear=backend, progress=False)
    assert other.model.gemm.name == backend
    assert_same_generations(Engine(other, EngineConfig()).generate(prompts, params), default)


def test_pointwise_backends_agree(
    make_engine: EngineFactory, loaded_fp32: LoadedModel, cache_dir: Path
) -> None:
    """The native row-wise kernels (RMSNorm, RoPE, silu * up) and the torch ops
    give the same greedy tokens and logprobs."""
    if loaded_fp32.model.ops.name != "native":
        pytest.skip("the native pointwise kernels are unavailable here")
    prompts = _prompts(loaded_fp32)[:3]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    native = make_engine().generate(prompts, params)
    plain = load_model(None, cache_dir=cache_dir, pointwise="torch", progress=False)
    assert plain.model.ops.name == "torch"
    assert_same_generations(Engine(plain, EngineConfig()).generate(prompts, params), native)


def test_chunked_prefill_matches_one_shot(
    make_engine: EngineFactory, loaded_fp32: LoadedModel
) -> None:
    prompts = _prompts(loaded_fp32)
    one_shot = make_engine().generate(prompts, GREEDY)
    chunked = make_engine(max_num_batched_tokens=13).generate(prompts, GREEDY)
    assert [c.token_ids for c in chunked] == [o.token_ids for o in one_shot]


def test_chunked_and_prefix_logits_equal_one_shot(loaded_fp32: LoadedModel) -> None:
    ids = _prompts(loaded_fp32)[4]
    full = prefill_logits(loaded_fp32, ids)
    cache = new_cache(loaded_fp32)
    pieces = []
    for start, end in ((0, 7), (7, 32), (32, len(ids))):  # unaligned and aligned chunks
        pieces.append(prefill_logits(loaded_fp32, ids[:end], start=start, cache=cache))
    assert torch.allclose(torch.cat(pieces), full, atol=1e-4, rtol=0)


def test_prefix_cache_hit_gives_same_tokens(
    make_engine: EngineFactory, loaded_fp32: LoadedModel
) -> None:
    base = _prompts(loaded_fp32)[4]
    engine = make_engine()
    cold = engine.generate([base], SamplingParams(max_tokens=16, temperature=0, logprobs=5))[0]
    warm = engine.generate([base], SamplingParams(max_tokens=16, temperature=0, logprobs=5))[0]
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == (len(base) - 1) // 16 * 16 > 0
    assert warm.token_ids == cold.token_ids
    for a, b in zip(cold.logprobs, warm.logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4
    # a different tenant (cache_salt) never hits the other tenant's blocks
    rid = engine.add_request(base, GREEDY, cache_salt="tenant-b")
    outs = [o for _ in range(2) for o in engine.step() if o.request_id == rid]
    assert outs[0].num_cached_tokens == 0
    engine.abort(rid)


def test_seeded_sampling_is_reproducible(
    make_engine: EngineFactory, loaded_fp32: LoadedModel
) -> None:
    prompts = _prompts(loaded_fp32)[:4]
    params = [
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=s)
        for s in range(4)
    ]
    first = make_engine().generate(prompts, params)
    # same seeds, other batch composition and order
    second = make_engine().generate(prompts[::-1], params[::-1])[::-1]
    assert [f.token_ids for f in first] == [s.token_ids for s in second]
    other = make_engine().generate(
        prompts, [SamplingParams(max_tokens=20, temperature=0.9, seed=s + 100) for s in range(4)]
    )
    assert [f.token_ids for f in first] != [o.token_ids for o in other]


def test_regenerating_from_any_position_reproduces_the_rest(
    make_engine: EngineFactory, loaded_fp32: LoadedModel
) -> None:
    prompt = _prompts(loaded_fp32)[2]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    full = make_engine().generate([prompt], params)[0].token_ids
    for cut in (1, 7, 16, 23):
        rest = (
            make_engine()
            .generate(
                [prompt + full[:cut]],
                SamplingParams(max_tokens=24 - cut, temperature=1.0, seed=1234, ignore_eos=True),
            )[0]
            .token_ids
        )
        assert rest == full[cut:], cut


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_of_generated_tokens_continues_exactly(cache_dir: Path, dtype: str) -> None:
    """What failover, recompute-preemption and a cached next chat turn rely on: a
    prompt that ends in tokens the engine generated, prefilled in one pass, continues
    with exactly the tokens generation went on with, greedy and seeded, in each dtype
    (bf16 rounds the KV it stores, so any prefill/decode difference would show)."""
    loaded = load_model(None, cache_dir=cache_dir, dtype=dtype, progress=False)
    # every request of a run in one batch (a row does not depend on its batch: the
    # ragged-batch test above), each prompt prefilled whole in one step, from no cache
    config = EngineConfig(
        dtype=dtype,  # type: ignore[arg-type]
        cache=CacheConfig(enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096),
    )
    prompts = _prompts(loaded)[1:7]
    seeds = [None if i % 2 else 77 + i for i in range(len(prompts))]

    def params(seed: int | None, max_tokens: int) -> SamplingParams:
        temperature = 0 if seed is None else 0.9
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True
        )

    full = Engine(loaded, config).generate(prompts, [params(s, 48) for s in seeds])
    cases = [(i, cut) for i in range(len(prompts)) for cut in (3, 17, 40)]
    rest = Engine(loaded, config).generate(
        [prompts[i] + full[i].token_ids[:cut] for i, cut in cases],
        [params(seeds[i], 48 - cut) for i, cut in cases],
    )
    for (i, cut), out in zip(cases, rest, strict=True):
        assert out.num_cached_tokens == 0
        assert out.token_ids == full[i].token_ids[cut:], (i, cut)


def test_preemption_under_kv_pressure_keeps_outputs(
    make_engine: EngineFactory, loaded_fp32: LoadedModel
) -> None:
    prompts = _prompts(loaded_fp32)
    reference = make_engine().generate(prompts, GREEDY)
    # 20 blocks of 16 tokens cannot hold all 8 sequences at once
    tight = make_engine(kv_cache_bytes=20 * 46_080 * 16)
    assert tight.kv.num_slots == 20
    out = tight.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == [r.token_ids for r in reference]
    assert tight.kv.num_free == tight.kv.num_slots


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_swapping_or_recomputing_under_kv_pressure_keeps_outputs(
    make_engine: EngineFactory, loaded_fp32: LoadedModel, mode: PreemptionSetting
) -> None:
    """Preempted requests whose KV went to host memory and came back, or was recomputed,
    continue with exactly the tokens (greedy and seeded) and logprobs of an unpressed
    run."""
    prompts = _prompts(loaded_fp32)
    params = [
        SamplingParams(
            max_tokens=40, temperature=0.8 if i % 2 else 0, seed=i, ignore_eos=True, logprobs=1
        )
        for i in range(len(prompts))
    ]
    reference = make_engine().generate(prompts, params)
    tight = make_engine(kv_cache_bytes=20 * 46_080 * 16, preemption_mode=mode)
    out = tight.generate(prompts, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in reference]
    for o, r in zip(out, reference, strict=True):
        assert [lp.logprob for lp in o.logprobs] == [lp.logprob for lp in r.logprobs]
    snap = tight.snapshot()
    stats = snap.swap
    assert snap.preemptions > 0
    if mode == "swap":
        assert stats.swaps_out == snap.preemptions == stats.swaps_in
        assert tight.swapper is not None
        assert tight.swapper.num_free == tight.swapper.num_host_blocks
    else:
        assert tight.swapper is None and stats.swaps_out == 0
    assert tight.kv.num_free == tight.kv.num_slots


def test_abort_frees_kv(make_engine: EngineFactory, loaded_fp32: LoadedModel) -> None:
    engine = make_engine()
    prompts = _prompts(loaded_fp32)
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    engine.step()
    assert engine.kv.num_free < engine.kv.num_slots
    for rid in rids:
        assert engine.abort(rid)
    assert not engine.abort(rids[0])
    assert not engine.has_unfinished()
    assert engine.kv.num_free == engine.kv.num_slots
    assert not engine.output.timings


def test_stop_string_cuts_text(make_engine: EngineFactory) -> None:
    engine = make_engine()
    ids = engine.tokenizer.encode_chat(CHAT_FRANCE)
    out = engine.generate([ids], SamplingParams(max_tokens=32, temperature=0, stop=(" is",)))[0]
    assert out.text == "The capital of France"
    assert out.finish_reason is FinishReason.STOP


def test_logprobs_are_consistent(make_engine: EngineFactory) -> None:
    engine = make_engine()
    ids = engine.tokenizer.encode_chat(CHAT_FRANCE)
    out = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0, logprobs=3))[0]
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][1])


def test_bad_input_is_rejected(make_engine: EngineFactory) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError):
        engine.add_request([], GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request([10**9], GREEDY)
    with pytest.raises(RequestTooLongError, match="context length"):
        engine.add_request([1] * 8190, SamplingParams(max_tokens=16))
    for bad in (
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"temperature": -0.5},
        {"top_p": 0.0},
        {"top_k": 0},
        {"logprobs": 21},
        {"presence_penalty": 3.0},
        {"temperature": float("nan")},
        {"stop": ("",)},
    ):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    assert not engine.has_unfinished()


def test_penalties_discourage_repeats(make_engine: EngineFactory, loaded_fp32: LoadedModel) -> None:
    prompt = loaded_fp32.tokenizer.encode("Repeat after me: la la la la la la la la")
    plain = make_engine().generate([prompt], GREEDY)[0].token_ids
    penal = (
        make_engine()
        .generate(
            [prompt],
            SamplingParams(
                max_tokens=24,
                temperature=0,
                ignore_eos=True,
                frequency_penalty=2.0,
                presence_penalty=2.0,
            ),
        )[0]
        .token_ids
    )
    assert len(set(penal)) > len(set(plain))
