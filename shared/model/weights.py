"""Reading safetensors weights of an HF model folder (single file or sharded index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from shared.errors import ModelFormatError, ModelNotFoundError


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFormatError(f"{index} is not a valid safetensors index: {e}") from e
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} holds no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        if not path.exists():
            raise ModelNotFoundError(f"weight shard {path} is missing")
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelFormatError(f"{path} is not a valid safetensors file: {e}") from e
    return state
