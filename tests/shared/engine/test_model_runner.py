"""Batch flattening (no model): row order, slots, segments, which rows are sampled."""

from __future__ import annotations

import torch

from shared.engine.kv_cache_manager import Slot
from shared.engine.model_runner import build_input, prefill_runs
from shared.engine.request import Request, RequestId
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from shared.model.attention import SlotRun, split_whole_blocks


def make_req(rid: str, prompt: int, computed: int, blocks: list[int], outputs: int = 0) -> Request:
    r = Request(
        request_id=RequestId(rid),
        prompt_token_ids=list(range(100, 100 + prompt)),
        params=SamplingParams(),
        seed=0,
        arrival=0.0,
    )
    r.output_token_ids = list(range(900, 900 + outputs))
    r.num_computed_tokens = computed
    r.slots = [Slot(b) for b in blocks]
    return r


def test_prefill_runs_cover_every_position_once() -> None:
    runs = prefill_runs(5, 3, 14, [7, 8, 9, 10], 4)
    assert runs == [
        SlotRun(row=5, block=7, offset=3, length=1),
        SlotRun(row=6, block=8, offset=0, length=4),
        SlotRun(row=10, block=9, offset=0, length=4),
        SlotRun(row=14, block=10, offset=0, length=2),
    ]
    assert sum(r.length for r in runs) == 14 - 3


def test_build_input_orders_decodes_first_and_samples_finished_prompts() -> None:
    prefill_done = make_req("p", prompt=6, computed=0, blocks=[3, 4])  # whole prompt: samples
    chunk = make_req("c", prompt=10, computed=0, blocks=[5, 6])  # first chunk only: no sample
    decode = make_req("d", prompt=4, computed=4, blocks=[1, 2], outputs=1)  # one new token
    step = SchedulerOutput(
        scheduled=(
            ScheduledRequest(prefill_done, 6),
            ScheduledRequest(chunk, 5),
            ScheduledRequest(decode, 1),
        ),
        preempted=(),
    )
    inp = build_input(step, block_size=4, device="cpu")
    assert inp.input_ids.tolist() == [900, *range(100, 106), *range(100, 105)]
    assert inp.positions.tolist() == [4, *range(6), *range(5)]
    m = inp.meta
    assert m.num_decodes == 1
    assert (m.slot_blocks.tolist(), m.slot_offsets.tolist()) == ([2], [0])
    (group,) = m.decode
    assert (group.start, group.end) == (0, 1)
    assert group.batch.tables.tolist() == [[1, 2]]
    assert group.batch.mask.tolist() == [[[False] * 5 + [True] * 3]]
    assert [(s.start, s.end, s.context_len) for s in m.prefills] == [(1, 7, 6), (7, 12, 5)]
    assert torch.equal(m.prefills[1].block_table, torch.tensor([5, 6]))
    assert inp.logits_rows.tolist() == [0, 6]  # decode row and the finished prompt's last row
    assert [s.request for s in inp.sampled] == [decode, prefill_done]
    # the last layer's sampled rows alone, each a decode row over its whole context
    assert m.sampled is not None
    (rows,) = m.sampled.decode
    assert (rows.start, rows.end, m.sampled.num_decodes, m.sampled.prefills) == (0, 2, 2, ())
    assert rows.batch.tables.tolist() == [[1, 2], [3, 4]]
    assert rows.batch.lens.tolist() == [5, 6]
    assert m.sampled.slot_runs == () and m.sampled.block_runs == ()


def test_a_chunk_that_samples_nothing_computes_no_row_past_its_last_kv() -> None:
    chunk = make_req("c", prompt=10, computed=0, blocks=[5, 6, 7])
    step = SchedulerOutput(scheduled=(ScheduledRequest(chunk, 5),), preempted=())
    inp = build_input(step, block_size=4, device="cpu")
    assert inp.logits_rows.tolist() == []
    assert inp.meta.sampled is not None and inp.meta.sampled.decode == ()


def test_a_step_whose_every_row_is_sampled_has_no_sampled_rows_metadata() -> None:
    decode = make_req("d", prompt=4, computed=4, blocks=[1, 2], outputs=1)
    one_token_prompt = make_req("p", prompt=1, computed=0, blocks=[3])
    step = SchedulerOutput(
        scheduled=(ScheduledRequest(decode, 1), ScheduledRequest(one_token_prompt, 1)),
        preempted=(),
    )
    assert build_input(step, block_size=4, device="cpu").meta.sampled is None


def test_decode_rows_group_by_context_width() -> None:
    from shared.model.attention import group_by_width

    assert group_by_width([]) == []
    assert group_by_width([3, 3, 4, 5]) == [4]  # similar lengths: one group
    assert group_by_width([2, 3, 40, 41, 96]) == [2, 4, 5]  # long contexts apart
    assert group_by_width([1, 2, 3, 9]) == [4]  # small absolute difference: keep together


def test_unpadded_decode_attention_gets_one_group() -> None:
    short = make_req("s", prompt=3, computed=3, blocks=[1], outputs=1)
    long = make_req("l", prompt=40, computed=40, blocks=list(range(2, 13)), outputs=1)
    step = SchedulerOutput(
        scheduled=(ScheduledRequest(long, 1), ScheduledRequest(short, 1)), preempted=()
    )
    assert len(build_input(step, block_size=4, device="cpu").meta.decode) == 2
    inp = build_input(step, block_size=4, device="cpu", split_decodes=False)
    (group,) = inp.meta.decode
    assert (group.start, group.end) == (0, 2)
    assert group.batch.lens.tolist() == [4, 41]  # sorted by length; the new token counts
    assert group.batch.tables.tolist() == [[1] * 11, list(range(2, 13))]


def test_whole_blocks_of_a_prompt_are_written_as_one_run() -> None:
    runs = prefill_runs(5, 3, 14, [7, 8, 9, 10], 4)  # partial, whole, whole, partial
    partial, whole = split_whole_blocks(runs, 4, "cpu")
    assert partial == [runs[0], runs[3]]
    assert [(w.row, w.blocks.tolist()) for w in whole] == [(6, [8, 9])]
    # rows that do not follow on (another segment) start a new run
    other = prefill_runs(20, 0, 4, [11], 4)
    _, whole = split_whole_blocks(runs + other, 4, "cpu")
    assert [(w.row, w.blocks.tolist()) for w in whole] == [(6, [8, 9]), (20, [11])]
