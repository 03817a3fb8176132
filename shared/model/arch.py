"""Architecture description of a Llama-family model, read from an HF ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.errors import ModelFormatError, UnsupportedModelError
from shared.model import families

SUPPORTED_ROPE_SCALING = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling`` as HF configs spell it (``rope_type`` ``linear`` or ``llama3``)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None

    @property
    def kv_bytes_per_token_per_elem(self) -> int:
        """K and V elements per token over all layers (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LlamaArch:
        families.for_hf(cfg)  # refuses what Baton does not serve, listing what it does
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            arch = cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                rope_scaling=_rope_scaling(cfg.get("rope_scaling")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(f"config.json is missing or has a bad field: {e}") from e
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise UnsupportedModelError("attention/MLP bias terms are not supported")
        if arch.num_heads % arch.num_kv_heads:
            raise ModelFormatError("num_attention_heads must be a multiple of num_key_value_heads")
        return arch

    def to_hf_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            cfg["rope_scaling"] = {
                "rope_type": rs.rope_type,
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
        return cfg


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind == "default":
        return None
    if kind not in SUPPORTED_ROPE_SCALING:
        raise UnsupportedModelError(
            f"rope_scaling type {kind!r} is not supported; "
            f"Baton implements {SUPPORTED_ROPE_SCALING}"
        )
    return RopeScaling(
        rope_type=str(kind),
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
