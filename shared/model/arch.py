"""Architecture description of a served model (Llama or Gemma 3 family), read from an
HF ``config.json``; :mod:`shared.model.families` says which families those are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.errors import ModelFormatError, UnsupportedModelError
from shared.model import families

SUPPORTED_ROPE_SCALING = ("linear", "llama3")
FULL, SLIDING = "full_attention", "sliding_attention"  # HF's names of the layer types
GEMMA3_PATTERN = 6  # Gemma 3: every 6th layer global, the rest sliding-window


@dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling`` as HF configs spell it (``rope_type`` ``linear`` or ``llama3``)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArch:
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
    family: str = "llama"
    hidden_act: str = "silu"  # silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    # sliding-window layers attend to their last `sliding_window` tokens only
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer; () means all FULL
    rope_local_theta: float | None = None  # RoPE base of sliding layers (None: rope_theta)
    query_pre_attn_scalar: float | None = None  # scores scale by its -1/2 (None: head_dim)

    def window(self, layer: int) -> int | None:
        """How many of the newest tokens layer ``layer`` attends to (None: all)."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    @property
    def has_windows(self) -> bool:
        """Whether any layer attends to a sliding window only."""
        return any(self.window(i) is not None for i in range(self.num_layers))

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_bytes_per_token_per_elem(self) -> int:
        """K and V elements per token over all layers (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        family = families.for_hf(cfg)  # refuses what Baton does not serve, listing what it does
        if family is families.GEMMA3:
            return _gemma3_from_hf(cfg)
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
        if self.family == families.GEMMA3.name:
            return _gemma3_to_hf(self)
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


def gemma3_layer_types(num_layers: int, pattern: int = GEMMA3_PATTERN) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def _gemma3_from_hf(cfg: dict[str, Any]) -> ModelArch:
    """A Gemma 3 text config, as transformers 4 (``rope_local_base_freq``) or 5
    (``rope_parameters`` per layer type) writes it."""
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(cap) is not None:
            raise UnsupportedModelError(f"Gemma {cap} is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"Gemma 3 activation {act!r} is not supported")
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}
        full = rope.get(FULL) or {}
        local = rope.get(SLIDING) or {}
        types = tuple(cfg.get("layer_types") or gemma3_layer_types(
            layers, int(cfg.get("sliding_window_pattern") or GEMMA3_PATTERN)
        ))  # fmt: skip
        arch = ModelArch(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or 256),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(full.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            rope_scaling=_rope_scaling(full if full.get("rope_type") else cfg.get("rope_scaling")),
            family=families.GEMMA3.name,
            hidden_act=act,
            sliding_window=int(cfg.get("sliding_window") or 512),
            layer_types=types,
            rope_local_theta=float(
                local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0
            ),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(f"config.json is missing or has a bad field: {e}") from e
    if len(arch.layer_types) != layers or set(arch.layer_types) - {FULL, SLIDING}:
        raise ModelFormatError(f"layer_types must name {FULL} or {SLIDING} for each layer")
    if arch.num_heads % arch.num_kv_heads:
        raise ModelFormatError("num_attention_heads must be a multiple of num_key_value_heads")
    return arch


def _number(x: float | None) -> float | int | None:
    """Whole numbers as ints: transformers' Gemma config is strict about the type."""
    return int(x) if x is not None and float(x).is_integer() else x


def _gemma3_to_hf(a: ModelArch) -> dict[str, Any]:
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.rope_scaling is not None:
        full |= {"rope_type": a.rope_scaling.rope_type, "factor": a.rope_scaling.factor}
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "rms_norm_eps": a.rms_norm_eps,
        "max_position_embeddings": a.max_position_embeddings,
        "tie_word_embeddings": a.tie_word_embeddings,
        "hidden_activation": a.hidden_act,
        "sliding_window": a.sliding_window,
        "layer_types": list(a.layer_types),
        "query_pre_attn_scalar": _number(a.query_pre_attn_scalar),
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        # both spellings: transformers 5 reads rope_parameters, 4 the flat keys
        "rope_parameters": {
            FULL: full,
            SLIDING: {"rope_type": "default", "rope_theta": a.rope_local_theta},
        },
        "rope_theta": a.rope_theta,
        "rope_local_base_freq": a.rope_local_theta,
        "torch_dtype": "float32",
    }
