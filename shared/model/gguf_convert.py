"""Read a GGUF file into the Hugging Face layout: config, fp32 weights, tokenizer.

Weights are dequantized with the ``gguf`` package. For Llama, GGUF stores the Q
and K projections permuted for llama.cpp's interleaved RoPE; we undo that so the
weights match the HF (rotate-half) convention our model uses. Gemma 3 files keep
HF's order, but store every RMSNorm weight as ``1 + w`` (llama.cpp multiplies by
it); HF's Gemma checkpoints hold ``w``, so 1 is taken off again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ModelFormatError, UnsupportedModelError
from shared.model import families
from shared.model.arch import ModelArch, RopeScaling, gemma3_layer_types
from shared.model.chat_templates import GEMMA_END_OF_TURN, GEMMA_TURNS
from shared.model.gguf_tokenizer import build_tokenizer

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA3_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file translated to the HF layout (everything a model folder holds)."""

    hf_config: dict[str, Any]
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]
    read_tensors: Callable[[], Iterator[tuple[str, np.ndarray]]]


def _open(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError, AssertionError) as e:
        raise ModelFormatError(f"{path} is not a readable GGUF file: {e}") from e


def _fields(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        try:
            out[name] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ModelFormatError(f"GGUF metadata field {name} is corrupt: {e}") from e
    return out


def _arch_from_meta(meta: dict[str, Any], has_output: bool) -> ModelArch:
    if meta.get("general.architecture") == families.GEMMA3.name:
        return _gemma3_arch(meta, has_output)

    def req(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise ModelFormatError(f"GGUF metadata lacks llama.{key}")
        return meta[f"llama.{key}"]

    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    vocab = int(meta.get("llama.vocab_size", len(meta.get("tokenizer.ggml.tokens", []))))
    scaling = None
    stype = meta.get("llama.rope.scaling.type")
    if stype not in (None, "none"):
        if stype != "linear":
            raise UnsupportedModelError(f"GGUF rope scaling {stype!r} is not supported")
        scaling = RopeScaling("linear", float(meta["llama.rope.scaling.factor"]))
    return ModelArch(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get("llama.context_length", 2048)),
        tie_word_embeddings=not has_output,
        rope_scaling=scaling,
    )


def _gemma3_arch(meta: dict[str, Any], has_output: bool) -> ModelArch:
    """Gemma 3 as llama.cpp reads it: the GGUF names the window but not which layers
    use it, their RoPE base or the query scale; those are fixed for the family (every
    6th layer global, local base 10,000, scores scaled by head_dim^-1/2)."""

    def get(key: str, default: Any = None) -> Any:
        if f"gemma3.{key}" not in meta and default is None:
            raise ModelFormatError(f"GGUF metadata lacks gemma3.{key}")
        return meta.get(f"gemma3.{key}", default)

    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", 256))
    layers = int(get("block_count"))
    vocab = int(get("vocab_size", len(meta.get("tokenizer.ggml.tokens", []))))
    scaling = None
    stype = meta.get("gemma3.rope.scaling.type")
    if stype not in (None, "none"):
        if stype != "linear":
            raise UnsupportedModelError(f"GGUF rope scaling {stype!r} is not supported")
        scaling = RopeScaling("linear", float(meta["gemma3.rope.scaling.factor"]))
    return ModelArch(
        vocab_size=vocab,
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 1_000_000.0)),
        max_position_embeddings=int(get("context_length", 32768)),
        tie_word_embeddings=not has_output,
        rope_scaling=scaling,
        family=families.GEMMA3.name,
        hidden_act="gelu_pytorch_tanh",
        sliding_window=int(get("attention.sliding_window")),
        layer_types=gemma3_layer_types(layers),
        rope_local_theta=10_000.0,
        query_pre_attn_scalar=float(head_dim),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute: interleaved RoPE pairs -> rotate-half halves."""
    out_dim = w.shape[0]
    return (
        w.reshape(n_head, out_dim // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def read_gguf(path: Path) -> GGUFModel:
    import gguf

    reader = _open(path)
    meta = _fields(reader)
    families.for_gguf(meta.get("general.architecture"))  # before anything is read
    families.check_gguf_types((t.name, t.tensor_type.name) for t in reader.tensors)
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(
            "GGUF rope_freqs (llama3-style frequency factors) not supported"
        )
    arch = _arch_from_meta(meta, has_output="output.weight" in names)
    gemma = arch.family == families.GEMMA3.name
    tokenizer = build_tokenizer(meta)
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None and int(idx) < len(tokens) else None

    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    tok_cfg = {
        "chat_template": meta.get("tokenizer.chat_template"),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        "add_bos_token": bool(
            meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
        ),
    }
    eos: int | list[int] | None = None if eos_id is None else int(eos_id)
    if gemma:
        # no template in the file: Gemma's turn format, whose turns end at
        # <end_of_turn>, a stop token beside <eos> (as HF's generation config has it)
        tok_cfg["chat_template"] = tok_cfg["chat_template"] or GEMMA_TURNS
        if eos_id is not None and GEMMA_END_OF_TURN in tokens:
            eos = [int(eos_id), tokens.index(GEMMA_END_OF_TURN)]
    gen_cfg = {
        "bos_token_id": None if bos_id is None else int(bos_id),
        "eos_token_id": eos,
    }
    hf_config = arch.to_hf_config() | gen_cfg

    layer_map = _GEMMA3_LAYER_MAP if gemma else _LAYER_MAP

    def read_tensors() -> Iterator[tuple[str, np.ndarray]]:
        for t in reader.tensors:
            hf_name = _hf_name(t.name, layer_map)
            if hf_name is None:
                continue
            try:
                w = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise UnsupportedModelError(
                    f"tensor {t.name}: quantization {t.tensor_type.name} cannot be dequantized"
                ) from e
            w = np.asarray(w, dtype=np.float32)
            expected = tuple(int(d) for d in reversed(t.shape))
            if w.size != int(np.prod(expected)):
                raise ModelFormatError(f"tensor {t.name} has {w.size} values, expected {expected}")
            w = w.reshape(expected)
            if gemma:
                if t.name.endswith("norm.weight"):
                    w = w - np.float32(1.0)
            elif t.name.endswith("attn_q.weight"):
                w = _unpermute(w, arch.num_heads)
            elif t.name.endswith("attn_k.weight"):
                w = _unpermute(w, arch.num_kv_heads)
            yield hf_name, np.ascontiguousarray(w)

    return GGUFModel(
        hf_config=hf_config,
        tokenizer_json=tokenizer.to_str(),
        tokenizer_config=tok_cfg,
        generation_config=gen_cfg,
        read_tensors=read_tensors,
    )


def _hf_name(gguf_name: str, layer_map: dict[str, str]) -> str | None:
    if gguf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in layer_map:
        return f"model.layers.{m.group(1)}.{layer_map[m.group(2)]}"
    return None


def convert_gguf_to_hf(path: Path, out_dir: Path, *, extra_meta: dict[str, Any]) -> None:
    """Write ``out_dir`` as an HF model folder (fp32 safetensors) holding ``path``'s model."""
    from safetensors.numpy import save_file

    model = read_gguf(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = dict(model.read_tensors())
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - set(tensors)
    if missing:
        raise ModelFormatError(f"GGUF file lacks tensors {sorted(missing)}")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(model.hf_config, indent=2))
    (out_dir / "tokenizer.json").write_text(model.tokenizer_json)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(model.tokenizer_config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(model.generation_config, indent=2))
    (out_dir / "baton_source.json").write_text(json.dumps(extra_meta, indent=2))
