"""What a model is without its weights: name, shape and tokenizer.

The gateway needs only this, so this module (and everything it imports) stays
free of torch and numpy: a gateway process is a tokenizer and an HTTP server,
not a copy of the tensor runtime. :mod:`shared.model.loader` builds the
runnable model on top of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ModelFormatError
from shared.model.arch import ModelArch
from shared.model.registry import resolve
from shared.model.tokenizer import Tokenizer


def read_arch(folder: Path) -> ModelArch:
    """The architecture in an HF model folder's ``config.json``."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{folder}/config.json is unreadable: {e}") from e
    return ModelArch.from_hf_config(cfg)


@dataclass(frozen=True)
class TokenizerOnly:
    """What the gateway needs of a model: its name, tokenizer and shape, no weights."""

    name: str
    arch: ModelArch
    tokenizer: Tokenizer


def load_tokenizer(spec: str | None, *, cache_dir: Path, progress: bool = False) -> TokenizerOnly:
    resolved = resolve(spec, cache_dir, progress=progress)
    return TokenizerOnly(
        resolved.name, read_arch(resolved.folder), Tokenizer.from_folder(resolved.folder)
    )
