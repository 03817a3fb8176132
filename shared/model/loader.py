"""``load_model``: spec (GGUF file, HF folder or default) -> a runnable model and its tokenizer."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from shared.config import LinearBackend, PointwiseBackend
from shared.errors import ConfigError, ModelFormatError
from shared.kv.layout import torch_dtype
from shared.model.arch import LlamaArch
from shared.model.linear import select_linear
from shared.model.llama import LlamaModel
from shared.model.pointwise import select_pointwise
from shared.model.registry import ResolvedModel, resolve
from shared.model.tokenizer import Tokenizer
from shared.model.weights import load_state_dict


@dataclass(frozen=True)
class LoadedModel:
    name: str
    identity: str  # stable id of the weights; part of every KV block key
    folder: Path
    arch: LlamaArch
    model: LlamaModel
    tokenizer: Tokenizer
    load_seconds: float


def load_model(
    spec: str | None,
    *,
    cache_dir: Path,
    dtype: str = "float32",
    device: str = "cpu",
    linear: LinearBackend = "auto",
    pointwise: PointwiseBackend = "auto",
    kernel_dir: Path | None = None,
    progress: bool = True,
) -> LoadedModel:
    """``kernel_dir``: where native kernels are built (default ``cache_dir/kernels``)."""
    resolved = resolve(spec, cache_dir, progress=progress)
    return load_resolved(
        resolved,
        dtype=dtype,
        device=device,
        linear=linear,
        pointwise=pointwise,
        kernel_dir=kernel_dir or cache_dir / "kernels",
    )


def _read_arch(folder: Path) -> LlamaArch:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{folder}/config.json is unreadable: {e}") from e
    return LlamaArch.from_hf_config(cfg)


def load_resolved(
    resolved: ResolvedModel,
    *,
    dtype: str,
    device: str,
    kernel_dir: Path,
    linear: LinearBackend = "auto",
    pointwise: PointwiseBackend = "auto",
) -> LoadedModel:
    if device == "cpu" and dtype == "float16":
        raise ConfigError("float16 is not supported on CPU; use float32 or bfloat16")
    t0 = time.perf_counter()
    arch = _read_arch(resolved.folder)
    tokenizer = Tokenizer.from_folder(resolved.folder)
    state = load_state_dict(resolved.folder)
    dt = torch_dtype(dtype)
    model = LlamaModel(
        arch,
        state,
        dt,
        device,
        select_linear(linear, dt, device, kernel_dir),
        select_pointwise(pointwise, dt, device, kernel_dir),
    )
    return LoadedModel(
        name=resolved.name,
        identity=resolved.identity,
        folder=resolved.folder,
        arch=arch,
        model=model,
        tokenizer=tokenizer,
        load_seconds=time.perf_counter() - t0,
    )


@dataclass(frozen=True)
class TokenizerOnly:
    """What the gateway needs of a model: its name, tokenizer and shape, no weights."""

    name: str
    arch: LlamaArch
    tokenizer: Tokenizer


def load_tokenizer(spec: str | None, *, cache_dir: Path, progress: bool = False) -> TokenizerOnly:
    resolved = resolve(spec, cache_dir, progress=progress)
    return TokenizerOnly(
        resolved.name, _read_arch(resolved.folder), Tokenizer.from_folder(resolved.folder)
    )
