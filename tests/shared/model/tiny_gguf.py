"""Test helper: write a tiny random Llama model as GGUF the way llama.cpp's converter does.

Q and K are permuted for interleaved RoPE, weights are quantized with the
``gguf`` package's own quantizer, and the vocabulary is the 256 byte-level
tokens plus two control tokens, so our loader's whole GGUF path runs on it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16


def bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute (HF rotate-half -> interleaved pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    vocab = 258

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab, HIDDEN), "model.norm.weight": 1 + w(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + w(HIDDEN),
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
            p + "mlp.gate_proj.weight": w(INTER, HIDDEN),
            p + "mlp.up_proj.weight": w(INTER, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, INTER),
        }
    return out


_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_tiny_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    qtype: GGMLQuantizationType,
    *,
    arch: str = "llama",
) -> None:
    wr = GGUFWriter(str(path), arch)
    wr.add_block_count(LAYERS)
    wr.add_context_length(256)
    wr.add_embedding_length(HIDDEN)
    wr.add_feed_forward_length(INTER)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv(KV_HEADS)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_rope_freq_base(10000.0)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("gpt2")
    tokens = [*bytes_to_unicode(), "<|start|>", "<|end|>"]
    wr.add_token_list(tokens)
    wr.add_token_types([1] * 256 + [3, 3])
    wr.add_token_merges([])
    wr.add_bos_token_id(256)
    wr.add_eos_token_id(257)
    wr.add_chat_template("{% for m in messages %}<|start|>{{ m['content'] }}<|end|>{% endfor %}")
    for name, w in weights.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_NAMES[rest]}"
        if gname.endswith("attn_q.weight"):
            w = permute(w, HEADS)
        elif gname.endswith("attn_k.weight"):
            w = permute(w, KV_HEADS)
        if w.ndim == 1 or qtype == GGMLQuantizationType.F32:
            wr.add_tensor(gname, w)
        else:
            wr.add_tensor(gname, quantize(w, qtype), raw_dtype=qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
