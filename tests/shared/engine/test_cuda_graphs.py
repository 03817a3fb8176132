"""What a decode step replayed from a CUDA graph is fed (pure logic: no GPU needed)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.cuda_graphs import BUCKETS, DecodeRows, bucket_for


@dataclass
class FakeRequest:
    """Only what DecodeRows reads of a request (a fake, for pure logic)."""

    tokens: list[int]
    slots: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int = 1
    extra: dict[str, int] = field(default_factory=dict)

    def token_at(self, pos: int) -> int:
        return self.tokens[pos]


@dataclass
class FakeScheduled:
    request: FakeRequest
    num_new_tokens: int = 1


def test_buckets_round_up_and_stop_at_the_largest() -> None:
    assert bucket_for(1, 64) == 1
    assert bucket_for(3, 64) == 4
    assert bucket_for(33, 64) == 48
    assert bucket_for(64, 64) == 64
    assert bucket_for(65, 64) is None
    assert bucket_for(BUCKETS[-1] + 1, 10**6) is None


def test_rows_follow_each_request_and_pad_on_the_scratch_slot() -> None:
    a = FakeRequest(tokens=list(range(100, 140)), slots=[7, 3, 9], num_computed_tokens=35)
    b = FakeRequest(tokens=list(range(200, 216)), slots=[4], num_computed_tokens=15)
    rows = DecodeRows.of([FakeScheduled(a), FakeScheduled(b)], 4, 16, scratch=99)  # type: ignore[list-item]
    assert rows.ids == [135, 215, 0, 0]
    assert rows.positions == [35, 15, 0, 0]
    assert rows.slot_blocks == [9, 4, 99, 99]  # position 35 is in the third block
    assert rows.slot_offsets == [3, 15, 0, 0]
    assert rows.tables == [[7, 3, 9], [4], [99], [99]]
