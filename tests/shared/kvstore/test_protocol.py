"""The KV store's wire headers refuse what a node could not serve, before it is sent."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.kvstore.protocol import Get, LayerRange

IDS = ["00" * 8]


def test_a_stream_of_some_layers_names_them_ascending() -> None:
    assert Get(ids=IDS, stream=True, layer_ids=[5, 11, 17]).layer_ids == [5, 11, 17]
    for bad in ([], [3, 3], [4, 2], [-1]):
        with pytest.raises(ValidationError):
            Get(ids=IDS, stream=True, layer_ids=bad)


def test_layer_ids_only_for_a_stream_and_not_with_a_range() -> None:
    with pytest.raises(ValidationError, match="only for a stream"):
        Get(ids=IDS, layer_ids=[1])
    with pytest.raises(ValidationError, match="only for a stream"):
        Get(ids=IDS, stream=True, layer_ids=[1], layers=LayerRange(start=0, stop=2))
