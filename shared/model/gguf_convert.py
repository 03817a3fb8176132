"""Read a GGUF file into the Hugging Face layout: config, fp32 weights, tokenizer.

Weights are dequantized with the ``gguf`` package. GGUF stores the Q and K
projections permuted for llama.cpp's interleaved RoPE; we undo that so the
weights match the HF (rotate-half) convention our model uses.
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
from shared.model.arch import LlamaArch, RopeScaling
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


def _arch_from_meta(meta: dict[str, Any], has_output: bool) -> LlamaArch:

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
    return LlamaArch(
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
        "pad_token": token("padding"),
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        "add_bos_token": bool(
            meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
        ),
    }
    gen_cfg = {
        "bos_token_id": None if bos_id is None else int(bos_id),
        "eos_token_id": None if eos_id is None else int(eos_id),
    }
    hf_config = arch.to_hf_config() | gen_cfg

    def read_tensors() -> Iterator[tuple[str, np.ndarray]]:
        for t in reader.tensors:
            hf_name = _hf_name(t.name)
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
            if t.name.endswith("attn_q.weight"):
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


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
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
