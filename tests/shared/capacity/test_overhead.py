"""Serving overhead: the fit from service timings against the profile (pure), and the
measurement on a real 1P:1D cluster."""

from __future__ import annotations

import pytest

from shared.capacity.overhead import Points, SideUse, fit, fit_side, measure_overhead
from shared.capacity.profile import SideCpu
from tests.shared.capacity.fake_profile import linear_profile


def test_fit_charges_what_the_service_adds_to_the_profiles_steps() -> None:
    p = linear_profile(prefill_s_per_token=0.001, decode_base_s=0.01, decode_per_seq_s=0.001)
    ttfts = {256: 0.256 + 0.04, 1024: 1.024 + 0.06}  # the median of what serving added
    # decode steps: 10 ms + 1 ms per stream in the engine; serving adds 3 + 0.5 per stream
    tpots = {b: (b * 160, 0.01 + 0.001 * b + 0.003 + 0.0005 * b) for b in (1, 8, 16)}
    o = fit(p, ttfts, tpots)
    assert o.request_s == pytest.approx(0.05)
    assert o.step_s == pytest.approx(0.003) and o.token_s == pytest.approx(0.0005)
    assert o.decode_step_s(4) == pytest.approx(0.005)


def test_fit_never_charges_a_negative_time() -> None:
    p = linear_profile(prefill_s_per_token=0.001, decode_base_s=0.01, decode_per_seq_s=0.0)
    o = fit(p, {512: 0.4}, {1: (128, 0.008)})  # faster than the profile: noise
    assert o.request_s == 0.0 and o.step_s == 0.0 and o.token_s == 0.0


def test_side_cpu_fit_recovers_the_cost_per_request_prompt_token_and_output_token() -> None:
    truth = SideCpu(request_s=0.004, prompt_token_s=3e-6, output_token_s=2e-4)
    shapes = [(3, 3 * 256, 6), (3, 3 * 1024, 6), (1, 128, 64), (8, 8 * 128, 8 * 64)]
    groups = [
        SideUse(r, p, o, truth.seconds(r, p, o), 2 * truth.seconds(r, p, o)) for r, p, o in shapes
    ]
    cluster = fit_side(groups, lambda g: g.cluster_s)
    assert cluster.request_s == pytest.approx(truth.request_s)
    assert cluster.prompt_token_s == pytest.approx(truth.prompt_token_s)
    assert cluster.output_token_s == pytest.approx(truth.output_token_s)
    assert fit_side(groups, lambda g: g.client_s).request_s == pytest.approx(0.008)
    # a coefficient that comes out below zero (noise) is charged as zero
    noisy = [SideUse(1, 100, 10, 0.01, 0.0), SideUse(2, 100, 20, 0.005, 0.0)]
    assert min(vars(fit_side(noisy, lambda g: g.cluster_s)).values()) >= 0.0
    assert fit_side([], lambda g: g.cluster_s) == SideCpu()


def test_measured_on_a_real_cluster() -> None:
    p = linear_profile(prefill_s_per_token=1e-6, decode_base_s=1e-6, decode_per_seq_s=0.0)
    points = Points(
        prompt_tokens=(32,),
        batches=(1, 2),
        stream_prompt=16,
        stream_tokens=6,
        long_stream_tokens=12,
    )
    o = measure_overhead(p, dtype="float32", points=points)
    # against a near-zero profile, the overhead is the whole service time
    assert 0.0 < o.request_s < 10.0
    assert o.decode_step_s(1) > 0.0
    # the gateway, the store and the load generator did work for those requests
    assert o.cluster.seconds(1, 32, 6) > 0.0 and o.client.seconds(1, 32, 6) > 0.0
    # and so did the workers' threads beside their engines (KV in and out, streaming)
    assert o.workers.seconds(1, 32, 6) > 0.0


def test_a_batch_of_longer_streams_keeps_prompt_noise_out_of_the_cost_per_token() -> None:
    """The profile's groups (Points): prompts sent alone, batches whose requests, prompt
    tokens and streamed tokens grow together, and one batch of longer streams. Two ticks
    of noise in one prompt group move the fitted cost per streamed token by a sixth
    without that last batch, and by under 2% with it."""
    truth = SideCpu(request_s=0.01, prompt_token_s=150e-6, output_token_s=400e-6)
    alone = [(6, 6 * 256, 12), (6, 6 * 1024, 12)]
    batches = [(b, b * 128, b * 64) for b in (1, 8, 16)]

    def fitted(shapes: list[tuple[int, int, int]]) -> float:
        groups = [
            SideUse(r, p, o, truth.seconds(r, p, o) + (0.02 if i == 0 else 0.0), 0.0)
            for i, (r, p, o) in enumerate(shapes)
        ]
        return fit_side(groups, lambda g: g.cluster_s).output_token_s

    without = fitted(alone + batches)
    with_long = fitted(alone + batches + [(8, 8 * 128, 8 * 320)])
    assert abs(without / truth.output_token_s - 1) > 0.15
    assert with_long == pytest.approx(truth.output_token_s, rel=0.02)
