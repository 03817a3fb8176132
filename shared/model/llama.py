"""A Llama-family decoder in plain torch (RMSNorm, RoPE, GQA, SwiGLU) over a paged KV pool.

The model holds only its weights (engines may share one model); the caller
passes the flattened ragged batch, the attention metadata, the KV pool and the
attention implementations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.kv.kv_cache import KVCache
from shared.model.arch import ModelArch
from shared.model.attention import AttentionMetadata, paged_attention, write_kv
from shared.model.attention_impl import AttentionImpl
from shared.model.decoder import (
    DecoderModel,
    LayerWeights,
    ModelWeights,
    pack_embedding,
    pack_projections,
    tensor_getter,
)
from shared.model.linear import Linear
from shared.model.pointwise import Pointwise
from shared.model.rope import Rope


def pack_weights(
    arch: ModelArch,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str,
    linear: Linear,
) -> ModelWeights:
    """``state`` (HF tensor names) -> :class:`ModelWeights` in ``dtype`` on ``device``."""

    get = tensor_getter(state, dtype, device)
    embed, lm_head = pack_embedding(arch, get, linear)
    layers = []
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        proj = pack_projections(arch, get, linear, p)
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=proj.qkv,
                o_proj=proj.o_proj,
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=proj.gate_up,
                down=proj.down,
            )
        )
    return ModelWeights(
        embed=embed, final_norm=get("model.norm.weight"), lm_head=lm_head, layers=tuple(layers)
    )


class LlamaModel(DecoderModel):
    def __init__(
        self,
        arch: ModelArch,
        weights: ModelWeights,
        dtype: torch.dtype,
        device: str,
        linear: Linear,
        pointwise: Pointwise,
    ):
        super().__init__(arch, weights, dtype, device, linear, pointwise)
        self.rope = Rope(arch, dtype, device)
        self.scale = arch.head_dim**-0.5

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
        logits_rows: torch.Tensor,
        attention: AttentionImpl,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        a = self.arch
        q_dim, kv_dim = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        n = input_ids.shape[0]
        ops, eps = self.ops, a.rms_norm_eps
        h = self.embed_tokens(input_ids)  # the residual stream: ours, added to in place
        layers = self.layers
        x = ops.rms_norm(h, layers[0].input_norm, eps)
        rows = meta  # the rows computed past the K/V writes: every row until the last layer
        sampled_only = False
        for idx, lw in enumerate(layers):
            qkv = self.gemm(x, lw.qkv)
            q, k = ops.rotary(qkv, positions, self.rope, a.num_heads, a.num_kv_heads)
            v = qkv[:, q_dim + kv_dim :].view(n, a.num_kv_heads, a.head_dim)
            k_pool, v_pool = kv.layer(idx)
            write_kv(k_pool, v_pool, k, v, meta, attention.decode)
            if on_layer is not None:
                on_layer(idx)
            if idx + 1 == len(layers) and meta.sampled is not None:  # no one reads the rest
                rows, n, sampled_only = meta.sampled, logits_rows.shape[0], True
                if n == 0:
                    return self.no_logits()
                q, k, v, h = q[logits_rows], k[logits_rows], v[logits_rows], h[logits_rows]
            attn = paged_attention(q, k, v, k_pool, v_pool, rows, self.scale, attention)
            x = ops.add_rms_norm_(
                h, self.gemm(attn.reshape(n, q_dim), lw.o_proj), lw.post_norm, eps
            )
            mlp = self.gemm(self.gemm.glu(x, lw.gate_up, "silu", ops), lw.down)
            if idx + 1 < len(layers):  # the next layer's input norm, with this add
                x = ops.add_rms_norm_(h, mlp, layers[idx + 1].input_norm, eps)
            else:
                h.add_(mlp)
        last = ops.rms_norm(h if sampled_only else h[logits_rows], self.final_norm, eps)
        return self.gemm(last, self.lm_head).float()
