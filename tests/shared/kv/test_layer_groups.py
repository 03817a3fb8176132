"""How a model's layers are grouped into pool slots: sliding-window layers apart from
full-attention ones, equal-width groups, and one group whenever a split cannot help."""

from __future__ import annotations

import pytest

from shared.kv.layer_groups import LayerGroups
from shared.model.arch import SLIDING, gemma3_layer_types


def windows(types: tuple[str, ...], size: int = 512) -> list[int | None]:
    return [size if t == SLIDING else None for t in types]


def test_gemma3_270m_splits_into_six_groups_of_three() -> None:
    groups = LayerGroups.split(windows(gemma3_layer_types(18)))
    assert groups.groups[0] == (5, 11, 17)
    assert groups.groups[1:] == ((0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert groups.width == 3 and groups.num_window_groups == 5 and groups.window == 512
    assert groups.place(17) == (0, 2) and groups.place(6) == (2, 2)
    assert sorted(layer for g in groups.groups for layer in g) == list(range(18))


def test_uneven_sliding_layers_pad_the_last_group() -> None:
    groups = LayerGroups.split(windows(gemma3_layer_types(26)))  # gemma-3-1b: 4 global
    assert groups.width == 4 and [len(g) for g in groups.groups] == [4, 4, 4, 4, 4, 4, 2]
    assert groups.num_layers == 26


@pytest.mark.parametrize(
    "layer_windows",
    [[None] * 4, [512] * 4, [None, 512, 256, 512]],
    ids=["no windows", "all sliding", "two window sizes"],
)
def test_one_group_when_a_split_cannot_help(layer_windows: list[int | None]) -> None:
    groups = LayerGroups.split(layer_windows)
    assert not groups.windowed and groups.groups == ((0, 1, 2, 3),) and groups.width == 4
    with pytest.raises(ValueError):
        groups.place(4)
