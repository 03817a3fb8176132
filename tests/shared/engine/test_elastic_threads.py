"""Elastic threads: the policy on scripted CPU samples (a fake source), and the
guarantee it rests on, on the real model: a step's results do not depend on the
thread count it ran on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.config import EngineConfig, SchedulerConfig
from shared.engine.elastic_threads import (
    PRESSED_CHECKS,
    CpuSample,
    ProcStatSource,
    ThreadGovernor,
    others_busy,
    threads_for,
)
from shared.engine.engine import Engine
from shared.engine.outputs import Completion, RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.shared.engine.fake_cpu import FakeCpuSource


def governor(source: FakeCpuSource, low: int = 1, high: int = 2) -> ThreadGovernor:
    return ThreadGovernor(source, low, high, sleep=source.advance)


def test_threads_for_counts_free_cores_within_bounds() -> None:
    assert threads_for(2, 0.0, 1, 2) == 2
    assert threads_for(2, 0.1, 1, 2) == 2  # a little noise leaves the core free
    assert threads_for(2, 0.5, 1, 2) == 1  # half a core used: not free
    assert threads_for(2, 2.0, 1, 2) == 1  # never below the floor
    assert threads_for(8, 0.0, 1, 4) == 4  # nor above the ceiling
    assert threads_for(8, 3.0, 2, 8) == 5


def test_others_busy_subtracts_own_time() -> None:
    before = CpuSample(at=10.0, busy_s=100.0, own_s=5.0)
    after = CpuSample(at=10.5, busy_s=101.0, own_s=5.5)  # 1 s of CPU in 0.5 s, half ours
    assert others_busy(before, after) == pytest.approx(1.0)
    assert others_busy(after, after) == 0.0
    # tick rounding can make own time exceed the total: never negative
    assert others_busy(before, CpuSample(10.5, 100.2, 5.5)) == 0.0


def test_grows_when_the_other_role_idles_and_shrinks_when_it_works() -> None:
    src = FakeCpuSource()
    gov = governor(src)
    assert gov.decide() == 2  # first step: nothing else running
    src.others = 1.0  # decode starts streaming
    src.advance(0.2)
    assert gov.decide() == 1
    src.advance(0.2)
    assert gov.decide() == 1
    src.others = 0.0  # decode done
    src.advance(0.2)
    assert gov.decide() == 2
    assert gov.changes == 3  # 1 -> 2 -> 1 -> 2


def test_after_an_idle_spell_it_counts_what_runs_now() -> None:
    src = FakeCpuSource()
    gov = governor(src)
    gov.decide()
    src.others, src.running = 1.0, 1
    src.advance(5.0)  # idle for 5 s: the window is stale
    assert gov.decide() == 1  # decided on the one thread running right now
    src.running = 0
    src.advance(5.0)
    assert gov.decide() == 2


def test_between_layers_it_shrinks_once_others_keep_running() -> None:
    src = FakeCpuSource()
    gov = governor(src)
    assert gov.decide() == 2  # a long prompt starts on both cores
    src.running = 1  # decode got a stream mid-step
    assert [gov.recheck() for _ in range(PRESSED_CHECKS - 1)] == [2] * (PRESSED_CHECKS - 1)
    assert gov.recheck() == 1  # seen at PRESSED_CHECKS layer boundaries in a row
    assert gov.changes == 2
    src.running = 0
    assert gov.recheck() == 1  # growing waits for the next step's decision
    src.advance(0.2)
    assert gov.decide() == 2


def test_a_blip_between_layers_does_not_shrink() -> None:
    src = FakeCpuSource()
    gov = governor(src)
    gov.decide()
    for running in [1, 0] * PRESSED_CHECKS + [1] * (PRESSED_CHECKS - 1):
        src.running = running
        assert gov.recheck() == 2  # never PRESSED_CHECKS in a row
    src.advance(0.2)
    gov.decide()  # a new step starts the count again
    src.running = 1
    assert gov.recheck() == 2


def test_short_windows_keep_the_last_decision() -> None:
    src = FakeCpuSource()
    gov = governor(src)
    assert gov.decide() == 2
    src.others = 2.0
    src.advance(0.01)  # shorter than one /proc/stat tick can resolve
    assert gov.decide() == 2
    src.advance(0.1)
    assert gov.decide() == 1


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        ThreadGovernor(FakeCpuSource(), 3, 2)
    with pytest.raises(ValueError):
        ThreadGovernor(FakeCpuSource(), 0, 2)


@pytest.mark.skipif(not ProcStatSource.available(), reason="no /proc/stat")
def test_proc_stat_source_reads_this_machine() -> None:
    src = ProcStatSource()
    a = src.sample()
    sum(i * i for i in range(200_000))  # some CPU of our own
    b = src.sample()
    assert b.at > a.at and b.own_s > a.own_s and b.busy_s >= a.busy_s
    assert src.cpus >= 1 and src.running_others() >= 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_switching_threads_between_steps_changes_no_result(cache_dir: Path, dtype: str) -> None:
    """A batch of prompts (prefill chunks and decode steps) run on 1 thread, and again
    with the thread count switched 2, 1, 2, ... between steps: identical tokens and
    bitwise identical logprobs."""
    loaded = load_model(None, cache_dir=cache_dir, dtype=dtype, progress=False)
    config = EngineConfig(  # 64-token steps: the long prompt is chunked over several
        dtype=dtype,  # type: ignore[arg-type]
        num_threads=1,
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )
    texts = ["The quick brown fox", "Python is a programming language. " * 30, "Hi"]
    prompts = [loaded.tokenizer.encode(t) for t in texts]
    params = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
    ]
    saved = torch.get_num_threads()
    try:
        fixed = Engine(loaded, config).generate(prompts, params)
        elastic = Engine(loaded, config)
        step, counts = elastic.step, iter(range(10_000))

        def switching_step() -> list[RequestOutput]:
            elastic.set_num_threads(2 - next(counts) % 2)
            return step()

        elastic.step = switching_step  # type: ignore[method-assign]
        switched = elastic.generate(prompts, params)
    finally:
        torch.set_num_threads(saved)
    _assert_identical(switched, fixed)


def _assert_identical(got: list[Completion], want: list[Completion]) -> None:
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want, strict=True):
        assert [lp.logprob for lp in g.logprobs] == [lp.logprob for lp in w.logprobs]
        assert [lp.top for lp in g.logprobs] == [lp.top for lp in w.logprobs]
