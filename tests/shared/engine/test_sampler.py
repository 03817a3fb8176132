"""Sampler logic on hand-made logits (no model)."""

from __future__ import annotations

import math
from collections import Counter

import torch

from shared.engine.sampler import (
    SamplingRow,
    apply_penalties,
    draw,
    filter_top_k_top_p,
    noise_key,
    sample,
    uniform,
)
from shared.engine.sampling_params import SamplingParams


def row(
    params: SamplingParams, seed: int = 0, pos: int = 0, outs: tuple[int, ...] = ()
) -> SamplingRow:
    return SamplingRow(params=params, seed=seed, position=pos, output_token_ids=outs)


def test_greedy_takes_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    out = sample(logits, [row(SamplingParams(temperature=0))] * 2)
    assert [o.token_id for o in out] == [1, 0]


def test_top_k_keeps_k_best() -> None:
    lg = filter_top_k_top_p(torch.tensor([1.0, 4.0, 3.0, 2.0]), top_k=2, top_p=1.0)
    assert torch.isinf(lg).tolist() == [True, False, False, True]


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    lg = filter_top_k_top_p(probs.log(), top_k=None, top_p=0.8)
    assert torch.isinf(lg).tolist() == [False, False, True, True]
    lg = filter_top_k_top_p(probs.log(), top_k=None, top_p=0.81)
    assert torch.isinf(lg).tolist() == [False, False, False, True]


def test_penalties_follow_openai_formula() -> None:
    lg = torch.zeros(4)
    apply_penalties(lg, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), [1, 1, 3])
    assert lg.tolist() == [0.0, -2.0, 0.0, -1.5]


def test_logit_bias_moves_greedy_choice_and_keeps_raw_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    biased = SamplingParams(temperature=0, logit_bias=((1, -100.0), (2, 1.5)), logprobs=0)
    out = sample(logits.clone(), [row(biased)])[0]
    assert out.token_id == 2
    assert out.logprobs is not None
    assert math.isclose(out.logprobs.logprob, float(torch.log_softmax(logits[0], -1)[2]))
    assert sample(logits, [row(SamplingParams(temperature=0))])[0].token_id == 1


def test_same_seed_and_position_same_token_any_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0)
    a = sample(logits, [row(p, seed=9, pos=5), row(p, seed=1, pos=5), row(p, seed=9, pos=6)])
    b = sample(logits[[2, 0]], [row(p, seed=9, pos=6), row(p, seed=9, pos=5)])
    assert [a[2].token_id, a[0].token_id] == [t.token_id for t in b]
    assert noise_key(9, 5) != noise_key(9, 6) != noise_key(10, 5)


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None].repeat(1, 1)
    p = SamplingParams(temperature=1.0)
    n = 3000
    counts = Counter(sample(logits, [row(p, seed=s, pos=0)])[0].token_id for s in range(n))
    for tok, pr in enumerate(probs.tolist()):
        sd = math.sqrt(n * pr * (1 - pr))
        assert abs(counts[tok] - n * pr) < 5 * sd


def test_logprobs_report_raw_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    out = sample(logits, [row(SamplingParams(temperature=0.5, logprobs=2), seed=3)])[0]
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs is not None
    assert out.logprobs.logprob == raw[out.token_id].item()
    assert [t for t, _ in out.logprobs.top] == [0, 1]


def test_draw_never_picks_a_token_of_probability_zero() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5, 0.0])
    for u in (0.0, 1e-12, 0.25, 0.5, 0.75, 1.0 - 2**-53):
        assert draw(probs, u) in (1, 4)
    assert draw(probs, 0.49) == 1 and draw(probs, 0.5) == 4


def test_uniform_draws_cover_the_unit_interval() -> None:
    draws = [uniform(7, p) for p in range(4000)]
    assert all(0.0 <= d < 1.0 for d in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.02
