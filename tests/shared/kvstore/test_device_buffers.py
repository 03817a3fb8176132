"""Copies the store client hands to the DMA engine: runs that continue in both source and
destination merge into one copy (checked on CPU tensors: the merging is pure logic)."""

from __future__ import annotations

import pytest
import torch

from shared.kvstore.device_buffers import coalesce, is_device, nbytes


def test_contiguous_runs_merge_and_copy_the_same_bytes() -> None:
    src = torch.arange(100, dtype=torch.uint8)
    dst = torch.zeros(100, dtype=torch.uint8)
    pairs = [
        (dst[0:10], src[0:10]),
        (dst[10:20], src[10:20]),  # continues both: merged
        (dst[30:40], src[20:30]),  # the destination jumps: a new copy
        (dst[40:50], src[30:40]),  # merged
        (dst[50:60], src[60:70]),  # the source jumps
    ]
    merged = coalesce(pairs)
    assert [d.numel() for d, _ in merged] == [20, 20, 10]
    for d, s in merged:
        d.copy_(s)
    want = torch.zeros(100, dtype=torch.uint8)
    for d, s in pairs:
        want[d.storage_offset() : d.storage_offset() + d.numel()] = s
    assert torch.equal(dst, want)


def test_views_of_different_tensors_never_merge() -> None:
    a, b = torch.zeros(20, dtype=torch.uint8), torch.zeros(20, dtype=torch.uint8)
    src = torch.ones(40, dtype=torch.uint8)
    pairs = [(a[10:20], src[0:10]), (b[0:10], src[10:20])]
    # even if b happened to start where a ends, they are separate allocations
    assert len(coalesce(pairs)) == 2


def test_host_buffers_are_not_device_buffers() -> None:
    assert not is_device(torch.zeros(3)) and not is_device(b"abc")
    assert nbytes(torch.zeros(3, dtype=torch.float32)) == 12
    assert nbytes(torch.zeros(3)) == 12 and nbytes(b"abc") == 3


def test_sizes_of_tensors_come_without_a_view_and_refuse_what_no_transport_takes() -> None:
    rows = torch.zeros((4, 30), dtype=torch.bfloat16)
    assert nbytes(rows[1]) == 60 and nbytes(rows) == 240
    assert nbytes(rows.view(torch.uint8)[2]) == 60
    with pytest.raises(ValueError, match="contiguous"):
        nbytes(rows[:, :3])  # a column slice: refused before a request names its size
