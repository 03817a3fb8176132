"""The model families Baton serves, in one place: what a checkpoint must name to be
served, which implementation runs it, what its KV cache holds and how it attends.

A checkpoint names its architecture in its GGUF metadata (``general.architecture``)
or its HF ``config.json`` (``architectures``, else ``model_type``). Loading looks the
name up here; anything else is refused before a process starts, in one line that
names what was found and lists what is served (``baton model list`` prints the
same). GGUF tensors are dequantized to fp32 once, when the file is converted; the
quantizations listed here are those the converter reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    name: str
    implementation: str  # the module that runs it
    gguf_architectures: tuple[str, ...]  # general.architecture
    hf_architectures: tuple[str, ...]  # config.json architectures
    model_types: tuple[str, ...]  # config.json model_type, when architectures is absent
    kv_layout: str  # what one token's KV holds, per layer
    attention: str  # which keys a query reads

    def describe(self) -> str:
        names = ", ".join((*self.gguf_architectures, *self.hf_architectures))
        return f"{self.name} ({names})"


LLAMA = Family(
    name="llama",
    implementation="shared.model.llama",
    gguf_architectures=("llama",),
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    model_types=("llama", "mistral"),
    kv_layout="K and V of every layer: [blocks, block_size, kv_heads, head_dim]",
    attention="causal over the whole context in every layer; grouped-query heads",
)
GEMMA3 = Family(
    name="gemma3",
    implementation="shared.model.gemma3",
    gguf_architectures=("gemma3",),
    hf_architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    kv_layout="K and V of every layer: [blocks, block_size, kv_heads, head_dim]",
    attention=(
        "sliding-window (the newest 512 tokens, RoPE base 10,000) in 5 of every 6 layers, "
        "causal over the whole context (RoPE base 1,000,000) in the 6th; QK-norm"
    ),
)
FAMILIES: tuple[Family, ...] = (LLAMA, GEMMA3)

# GGUF tensor types the converter dequantizes (GGMLQuantizationType names)
GGUF_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip


def served() -> str:
    return "; ".join(f.describe() for f in FAMILIES)


def for_gguf(architecture: object) -> Family:
    """The family of a GGUF file's ``general.architecture``."""
    for family in FAMILIES:
        if architecture in family.gguf_architectures:
            return family
    raise UnsupportedModelError(
        f"GGUF architecture {architecture!r} is not supported; Baton serves {served()}"
    )


def for_hf(config: Mapping[str, Any]) -> Family:
    """The family of an HF ``config.json``."""
    archs = config.get("architectures") or []
    for family in FAMILIES:
        if any(a in family.hf_architectures for a in archs) or (
            not archs and config.get("model_type") in family.model_types
        ):
            return family
    found = archs or [config.get("model_type", "?")]
    raise UnsupportedModelError(f"architecture {found} is not supported; Baton serves {served()}")


def check_gguf_types(types: Iterable[tuple[str, str]]) -> None:
    """``types``: (tensor name, GGML type name) of every tensor; refuses the first
    type the converter cannot read, naming the tensor."""
    for tensor, kind in types:
        if kind not in GGUF_TYPES:
            raise UnsupportedModelError(
                f"tensor {tensor}: GGUF type {kind} is not supported; Baton reads "
                f"{', '.join(GGUF_TYPES)}"
            )


def table() -> list[dict[str, str]]:
    """What ``baton model list`` prints: one row per family."""
    return [
        {
            "family": f.name,
            "gguf": ", ".join(f.gguf_architectures),
            "hf": ", ".join(f.hf_architectures),
            "kv": f.kv_layout,
            "attention": f.attention,
            "quantizations (GGUF)": ", ".join(GGUF_TYPES),
        }
        for f in FAMILIES
    ]
