"""``load_model``: spec (GGUF file, HF folder or default) -> a runnable model and its tokenizer."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.config import LinearBackend, PointwiseBackend
from shared.errors import ConfigError
from shared.heap import release_freed_memory
from shared.kernels.gemm import GemmKernel
from shared.kv.layout import torch_dtype
from shared.model import families, gemma3, llama
from shared.model.arch import ModelArch
from shared.model.decoder import DecoderModel, ModelWeights
from shared.model.linear import Linear, select_linear
from shared.model.packed_file import load_or_pack, packed_path, packing_code
from shared.model.pointwise import select_pointwise
from shared.model.registry import ResolvedModel, resolve
from shared.model.tokenizer import Tokenizer
from shared.model.tokenizer_loader import read_arch
from shared.model.weights import load_state_dict

PackWeights = Callable[[ModelArch, dict[str, torch.Tensor], torch.dtype, str, Linear], ModelWeights]
# each family's packing and model, keyed by families.Family.name
IMPLEMENTATIONS: dict[str, tuple[PackWeights, type[DecoderModel]]] = {
    families.LLAMA.name: (llama.pack_weights, llama.LlamaModel),
    families.GEMMA3.name: (gemma3.pack_weights, gemma3.Gemma3Model),
}


@dataclass(frozen=True)
class LoadedModel:
    name: str
    identity: str  # stable id of the weights; part of every KV block key
    folder: Path
    arch: ModelArch
    model: DecoderModel
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
    """``kernel_dir``: where native kernels are built (default ``cache_dir/kernels``);
    packed weights are kept in ``cache_dir/packed`` and mapped by every process."""
    resolved = resolve(spec, cache_dir, progress=progress)
    return load_resolved(
        resolved,
        dtype=dtype,
        device=device,
        linear=linear,
        pointwise=pointwise,
        kernel_dir=kernel_dir or cache_dir / "kernels",
        packed_dir=cache_dir / "packed",
    )


def load_resolved(
    resolved: ResolvedModel,
    *,
    dtype: str,
    device: str,
    kernel_dir: Path,
    linear: LinearBackend = "auto",
    pointwise: PointwiseBackend = "auto",
    packed_dir: Path | None = None,
) -> LoadedModel:
    """``packed_dir``: where the packed weights are shared through a file (see
    :mod:`shared.model.packed_file`); None, or a backend whose packing is opaque,
    keeps them private to this process."""
    if device == "cpu" and dtype == "float16":
        raise ConfigError("float16 is not supported on CPU; use float32 or bfloat16")
    t0 = time.perf_counter()
    arch = read_arch(resolved.folder)
    tokenizer = Tokenizer.from_folder(resolved.folder)
    dt = torch_dtype(dtype)
    gemm = select_linear(linear, dt, device, kernel_dir)
    pack_weights, model_class = IMPLEMENTATIONS[arch.family]

    def pack() -> ModelWeights:
        return pack_weights(arch, load_state_dict(resolved.folder), dt, device, gemm)

    tag = gemm.cache_tag()
    if packed_dir is not None and tag is not None and device == "cpu":
        code = packing_code(pack_weights, type(gemm), GemmKernel, DecoderModel, load_state_dict)
        path = packed_path(
            packed_dir,
            resolved.name,
            resolved.identity,
            resolved.folder,
            dtype,
            gemm.name,
            tag,
            code,
        )
        weights = load_or_pack(path, pack)
    else:
        weights = pack()
        release_freed_memory()  # the checkpoint's and the packing's intermediate copies
    model = model_class(
        arch, weights, dt, device, gemm, select_pointwise(pointwise, dt, device, kernel_dir)
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
