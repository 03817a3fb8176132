from __future__ import annotations

import numpy as np
import pytest

from shared.errors import ProtocolError
from shared.transport.base import (
    PREAMBLE,
    Frame,
    as_bytes_view,
    check_into,
    decode_preamble,
    decode_sizes,
    encode_preamble,
)
from shared.transport.ucx import COALESCE_BYTES, plan_groups


def test_preamble_round_trip() -> None:
    raw = encode_preamble(b'{"op":"get"}', [5, 0, 1 << 33])
    header_len, nseg = decode_preamble(raw)
    assert (header_len, nseg) == (12, 3)
    body = raw[PREAMBLE.size :]
    assert body[:header_len] == b'{"op":"get"}'
    assert decode_sizes(body[header_len:]) == (5, 0, 1 << 33)


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\n",
        b"BTKV\x09\x00\x00\x00" + bytes(8),
        b"BTKV\x01\x00\x00\x00\xff\xff\xff\xff" + bytes(4),
    ],
)
def test_garbage_preamble_is_a_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_preamble(raw[: PREAMBLE.size].ljust(PREAMBLE.size, b"\0"))


def test_receive_buffers_must_match_the_frame() -> None:
    frame = Frame(b"", (4, 8))
    assert [v.nbytes for v in check_into(frame, [bytearray(4), np.empty(2, np.float32)])] == [4, 8]
    with pytest.raises(ValueError):
        check_into(frame, [bytearray(4), bytearray(7)])
    with pytest.raises(ValueError):
        check_into(frame, [bytes(4), bytearray(8)])  # read-only


def test_views_of_numpy_and_torch_are_flat_bytes() -> None:
    import torch

    assert as_bytes_view(np.zeros((3, 4), np.float32)).nbytes == 48
    assert as_bytes_view(torch.zeros(2, 5, dtype=torch.bfloat16)).nbytes == 20
    pool = torch.arange(24, dtype=torch.uint8).reshape(3, 8)
    row = as_bytes_view(pool[1])  # a pool's block row: its own bytes, shared, writable
    assert row.format == "B" and bytes(row) == bytes(range(8, 16))
    row[0] = 99
    assert int(pool[1, 0]) == 99
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes_view(pool[:, 0])


@pytest.mark.parametrize(
    "sizes",
    [[], [10], [COALESCE_BYTES] * 3, [1000] * 700, [24576] * 91 + [737280] * 3 + [5, 0, 7]],
)
def test_ucx_groups_cover_every_segment_once_in_order(sizes: list[int]) -> None:
    groups = plan_groups(sizes)
    covered = [i for g in groups for i in range(g.start, g.stop)]
    assert covered == [
        i for i, s in enumerate(sizes) if s or any(g.start <= i < g.stop for g in groups)
    ]
    assert [g.nbytes for g in groups] == [sum(sizes[g.start : g.stop]) for g in groups]
    assert all(not g.staged or g.nbytes <= 2 * COALESCE_BYTES for g in groups)
    assert all(
        g.staged or sizes[g.start] >= COALESCE_BYTES or len(sizes) == 1 or True for g in groups
    )
    assert sum(g.nbytes for g in groups) == sum(sizes)
