"""The deployment simulator on small workloads whose timings can be worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.capacity.profile import PrefillPoint, ServiceOverhead, SideCpu
from shared.capacity.sim_types import Deployment, SimRequest
from shared.capacity.simulator import simulate
from tests.shared.capacity.fake_profile import linear_profile

ONE = Deployment(prefill=1, decode=1)


def test_one_request_prefills_then_decodes_one_token_per_step() -> None:
    p = linear_profile(prefill_s_per_token=0.001, decode_base_s=0.01, decode_per_seq_s=0.0)
    res = simulate([SimRequest(0.0, 512, 11)], ONE, p, cores=2)
    (o,) = res.outcomes
    assert o.ttft_s == pytest.approx(0.512)
    assert o.tpot_s == pytest.approx(0.01, rel=1e-3)  # 10 decode steps of 10 ms
    assert res.duration_s == pytest.approx(0.512 + 0.1, rel=1e-3)


def test_serving_overhead_lengthens_each_prompt_and_decode_step() -> None:
    p = linear_profile(prefill_s_per_token=0.001, decode_base_s=0.01, decode_per_seq_s=0.0)
    served = replace(p, overhead=ServiceOverhead(request_s=0.1, step_s=0.002, token_s=0.001))
    (o,) = simulate([SimRequest(0.0, 512, 11)], ONE, served, cores=2).outcomes
    assert o.ttft_s == pytest.approx(0.512 + 0.1)
    assert o.tpot_s == pytest.approx(0.01 + 0.002 + 0.001, rel=1e-3)  # a batch of one
    # the per-prompt part is a wait on the way to the first token, not prefill CPU: a
    # prompt queued behind another does not wait for it (the sides charge the CPU)
    two = simulate([SimRequest(0.0, 512, 2), SimRequest(0.0, 512, 2)], ONE, served, cores=2)
    assert [round(o.ttft_s, 6) for o in two.outcomes] == [0.612, 1.124]


def test_side_processes_take_cores_from_the_engines_only_when_cores_are_short() -> None:
    """The gateway and store burn 50 ms per request and 5 ms per streamed token: on
    one core (decode and that work share it) the streams slow down; on two, they do
    not. The client's CPU counts only when it runs on the same machine."""
    p = linear_profile(prefill_s_per_token=0.001, decode_base_s=0.01, decode_per_seq_s=0.0)
    busy = SideCpu(request_s=0.05, output_token_s=0.005)
    sided = replace(p, overhead=ServiceOverhead(cluster=busy))
    reqs = [SimRequest(0.0, 512, 11)]
    (plain,) = simulate(reqs, ONE, p, cores=1).outcomes
    (short,) = simulate(reqs, ONE, sided, cores=1).outcomes
    (spare,) = simulate(reqs, ONE, sided, cores=2).outcomes
    assert short.ttft_s == pytest.approx(plain.ttft_s)  # charged from the first token on
    assert short.tpot_s > plain.tpot_s * 1.2
    assert spare.tpot_s == pytest.approx(plain.tpot_s)
    clients = replace(p, overhead=ServiceOverhead(client=busy))
    (remote,) = simulate(reqs, ONE, clients, cores=1).outcomes
    (local,) = simulate(reqs, ONE, clients, cores=1, client_on_host=True).outcomes
    assert remote.tpot_s == pytest.approx(plain.tpot_s)
    assert local.tpot_s == pytest.approx(short.tpot_s)
    workers = replace(p, overhead=ServiceOverhead(workers=busy))  # always on the host
    (moving,) = simulate(reqs, ONE, workers, cores=1).outcomes
    assert moving.tpot_s == pytest.approx(short.tpot_s)


def test_batched_prompts_cost_their_own_curves_and_chunks_their_increments() -> None:
    p = replace(
        linear_profile(),
        prefill=(PrefillPoint(1, 64, 0.064), PrefillPoint(1, 512, 0.6), PrefillPoint(1, 2048, 4.0)),
    )
    three = simulate([SimRequest(0.0, 512, 1) for _ in range(3)], ONE, p, cores=2)
    # one prompt per step, each its own 0.6 s (not the time of one 1,536-token prompt):
    # first tokens one after another, as the prefill role computes them
    assert [round(o.ttft_s, 6) for o in three.outcomes] == [0.6, 1.2, 1.8]
    chunked = Deployment(prefill=1, decode=1, max_batched_tokens=512)
    (o,) = simulate([SimRequest(0.0, 1024, 1)], chunked, p, cores=2).outcomes
    assert o.ttft_s == pytest.approx(p.prefill_seconds(1024, 1))  # 0.6 + what 512 more add


def test_prompts_queue_behind_the_token_budget() -> None:
    p = linear_profile(prefill_s_per_token=0.001)
    dep = Deployment(prefill=1, decode=1, max_batched_tokens=512)
    res = simulate([SimRequest(0.0, 512, 2), SimRequest(0.0, 512, 2)], dep, p, cores=2)
    assert [round(o.ttft_s, 3) for o in res.outcomes] == [0.512, 1.024]
    two = simulate([SimRequest(0.0, 512, 2), SimRequest(0.0, 512, 2)], Deployment(2, 1), p, cores=3)
    assert [round(o.ttft_s, 3) for o in two.outcomes] == [0.512, 0.512]


def test_instances_sharing_cores_progress_at_their_share() -> None:
    """Processor sharing: two prefills of 0.512 s and 0.256 s on one core run at half
    speed together; the short one ends at 0.512 s, then the long one runs alone."""
    p = linear_profile(prefill_s_per_token=0.001)
    reqs = [SimRequest(0.0, 512, 1), SimRequest(0.0, 256, 1)]
    alone = simulate(reqs, Deployment(2, 1), p, cores=3)
    assert [round(o.ttft_s, 3) for o in alone.outcomes] == [0.512, 0.256]
    shared = simulate(reqs, Deployment(2, 1), p, cores=1)
    assert [round(o.ttft_s, 3) for o in shared.outcomes] == [0.768, 0.512]


def test_blocks_the_store_holds_are_loaded_not_computed() -> None:
    p = linear_profile(prefill_s_per_token=0.001)
    first = SimRequest(0.0, 1024, 2, block_ids=(1, 2), block_tokens=512)
    again = SimRequest(5.0, 1024, 2, block_ids=(1, 2), block_tokens=512)
    other = SimRequest(10.0, 1024, 2, block_ids=(3, 4), block_tokens=512)
    res = simulate([first, again, other], ONE, p, cores=2)
    ttft = [o.ttft_s for o in res.outcomes]
    assert ttft[0] == pytest.approx(1.024)
    assert ttft[1] == pytest.approx(0.001, rel=0.1)  # only the last token computed
    assert ttft[2] == pytest.approx(1.024)


def test_decode_batches_cap_at_max_seqs_and_goodput_counts_slo_met() -> None:
    p = linear_profile(prefill_s_per_token=0.0001, decode_base_s=0.01, decode_per_seq_s=0.001)
    reqs = [SimRequest(0.0, 64, 50) for _ in range(8)]
    wide = simulate(reqs, Deployment(1, 1, max_seqs=8), p, cores=2)
    narrow = simulate(reqs, Deployment(1, 1, max_seqs=2), p, cores=2)
    assert narrow.duration_s > wide.duration_s
    slo_tpot = max(o.tpot_s for o in wide.outcomes)
    assert wide.goodput(10.0, slo_tpot) == pytest.approx(8 / wide.duration_s)
    assert wide.goodput(10.0, slo_tpot / 2) == 0.0


def test_a_deployment_needs_both_roles() -> None:
    with pytest.raises(ValueError):
        simulate([SimRequest(0.0, 8, 2)], Deployment(0, 1), linear_profile(), cores=1)


def test_instance_stats_count_each_engines_steps_work_and_share_of_a_core() -> None:
    """Alone on two cores each engine gets a whole core; a prefill and a decode engine
    busy together on one core get half of it each while both step."""
    p = linear_profile(prefill_s_per_token=0.001, decode_base_s=0.01, decode_per_seq_s=0.0)
    alone = simulate([SimRequest(0.0, 512, 11)], ONE, p, cores=2)
    pre, dec = alone.instances
    assert (pre.role, pre.steps, dec.role, dec.steps) == ("prefill", 1, "decode", 10)
    assert pre.work_s == pytest.approx(0.512) and pre.share == pytest.approx(1.0)
    assert dec.work_s == pytest.approx(0.1) and dec.share == pytest.approx(1.0)
    # the second prompt's prefill overlaps the first one's decode on one core
    shared = simulate([SimRequest(0.0, 100, 201), SimRequest(0.0, 1000, 2)], ONE, p, cores=1)
    pre, dec = shared.instances
    # 200 steps of 10 ms (the second request's one decode step joins one of them)
    assert pre.work_s == pytest.approx(1.1) and dec.work_s == pytest.approx(2.0)
    assert 0.5 <= pre.share < 1.0 and 0.5 <= dec.share < 1.0
    assert pre.busy_s + dec.busy_s > shared.duration_s  # they overlapped


def test_side_stats_are_what_serving_charged_each_process_beside_the_engines() -> None:
    p = linear_profile(prefill_s_per_token=0.001, decode_base_s=0.01, decode_per_seq_s=0.0)
    cost = SideCpu(request_s=0.05, prompt_token_s=0.0001, output_token_s=0.005)
    sided = replace(p, overhead=ServiceOverhead(cluster=cost, client=cost))
    res = simulate([SimRequest(0.0, 500, 11)], ONE, sided, cores=2, client_on_host=True)
    charged = {s.name: s.cpu_s for s in res.sides}
    assert charged["cluster"] == pytest.approx(0.05 + 0.05 + 11 * 0.005)  # all 11 tokens
    assert charged["client"] == pytest.approx(charged["cluster"])
    assert charged["workers"] == 0.0
    remote = simulate([SimRequest(0.0, 500, 11)], ONE, sided, cores=2)
    assert "client" not in {s.name for s in remote.sides}


def test_prompts_that_end_in_one_step_are_spread_over_the_decode_instances() -> None:
    """Their KV is still loading when the next one is routed: the gateway counts its own
    picks, and so does the simulation, or every one would go to the first instance."""
    p = linear_profile(transfer_bytes_s=1e5)  # 1 s to load a 100-token prompt
    # a prompt with no decoding keeps the prefill busy while four more queue behind it;
    # they end 0.1 s apart, each while the ones before it still load
    burst = [SimRequest(0.0, 500, 1)] + [SimRequest(0.0, 100, 21) for _ in range(4)]
    res = simulate(burst, Deployment(prefill=1, decode=2), p, cores=4)
    pre, first, second = res.instances
    assert pre.steps == 5  # one prompt per step
    # two streams each: one stream alone decodes its 20 tokens in 20 steps, and the two
    # of an instance, routed 0.2 s apart, overlap in few of theirs
    assert first.steps > 21 and second.steps > 21


def test_paced_decode_gives_its_core_to_prefill_while_a_prompt_is_computed() -> None:
    """2P:1D on 2 cores (3 threads): a stream decoding at 10 ms a step beside two
    prompts slows them to 2/3 speed. Paced to 40 ms while a prefill instance computes,
    it runs a quarter of the time, the prompts finish sooner and its steps come every
    40 ms; once prefill is idle, it runs back to back again."""
    p = linear_profile(prefill_s_per_token=0.001, decode_base_s=0.01, decode_per_seq_s=0.0)
    reqs = [SimRequest(0.0, 16, 200), SimRequest(0.1, 1000, 2), SimRequest(0.1, 1000, 2)]
    plain = Deployment(prefill=2, decode=1)
    paced = replace(plain, pace_s=0.04)
    before = simulate(reqs, plain, p, cores=2).outcomes
    after = simulate(reqs, paced, p, cores=2).outcomes
    assert after[1].ttft_s < before[1].ttft_s * 0.9  # the prompts get more of the cores
    assert after[0].tpot_s > before[0].tpot_s  # the stream gives it
    assert after[0].tpot_s < 0.04  # paced only while the prompts are computed
    alone = simulate(reqs[:1], paced, p, cores=2).outcomes[0]
    assert alone.tpot_s == pytest.approx(0.01, rel=1e-3)  # nobody to give it to
    assert "decode paced to 40 ms" in paced.describe()
