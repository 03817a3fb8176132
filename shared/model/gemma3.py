"""Gemma 3 (text) over the paged KV pool: what sets it apart from Llama.

- Sliding-window layers: 5 of every 6 attend to their 512 newest tokens only, with
  RoPE base 10,000; the 6th is global (base 1,000,000). ``arch.window(i)`` says which.
- QK-norm: each query and key head is RMS-normalized before RoPE.
- Sandwich norms: the attention's and the MLP's outputs are normalized before
  their residual adds, besides the usual norms before each.
- GeGLU (tanh GELU) instead of SwiGLU; embeddings scaled by sqrt(hidden); the
  scores by ``query_pre_attn_scalar ** -0.5``; the head tied to the embedding.

RMSNorm multiplies by ``1 + w`` (HF's Gemma checkpoints hold ``w``); the packed
weights keep ``1 + w``, so the model runs the same norm op as Llama's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.errors import ModelFormatError
from shared.kv.kv_cache import KVCache
from shared.model.arch import ModelArch
from shared.model.attention import AttentionMetadata, paged_attention, write_kv
from shared.model.attention_impl import AttentionImpl
from shared.model.decoder import (
    DecoderModel,
    LayerWeights,
    ModelWeights,
    expect,
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
    """``state`` (HF Gemma 3 tensor names) -> :class:`ModelWeights`."""
    a = arch
    raw = tensor_getter(state, torch.float32, "cpu")
    get = tensor_getter(state, dtype, device)

    def norm(name: str, width: int) -> torch.Tensor:
        # 1 + w in fp32, as HF computes it, then the model's dtype
        w = expect(raw(name), (width,), name)
        return (1.0 + w).to(dtype=dtype, device=device).contiguous()

    embed, lm_head = pack_embedding(a, get, linear)
    layers = []
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        proj = pack_projections(a, get, linear, p)
        layers.append(
            LayerWeights(
                input_norm=norm(p + "input_layernorm.weight", a.hidden_size),
                qkv=proj.qkv,
                o_proj=proj.o_proj,
                post_norm=norm(p + "pre_feedforward_layernorm.weight", a.hidden_size),
                gate_up=proj.gate_up,
                down=proj.down,
                q_norm=norm(p + "self_attn.q_norm.weight", a.head_dim),
                k_norm=norm(p + "self_attn.k_norm.weight", a.head_dim),
                attn_out_norm=norm(p + "post_attention_layernorm.weight", a.hidden_size),
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight", a.hidden_size),
            )
        )
    return ModelWeights(
        embed=embed,
        final_norm=norm("model.norm.weight", a.hidden_size),
        lm_head=lm_head,
        layers=tuple(layers),
    )


@dataclass(frozen=True)
class GemmaNorms:
    """A layer's norms beyond Llama's (each holds ``1 + w``)."""

    q: torch.Tensor  # [head_dim], each query head
    k: torch.Tensor  # [head_dim], each key head
    attn_out: torch.Tensor  # the attention's output, before its residual add
    mlp_out: torch.Tensor  # the MLP's output, before its residual add

    @classmethod
    def of(cls, i: int, lw: LayerWeights) -> GemmaNorms:
        if lw.q_norm is None or lw.k_norm is None or lw.attn_out_norm is None:
            raise ModelFormatError(f"layer {i} lacks Gemma 3's QK and output norms")
        if lw.mlp_out_norm is None:
            raise ModelFormatError(f"layer {i} lacks Gemma 3's MLP output norm")
        return cls(lw.q_norm, lw.k_norm, lw.attn_out_norm, lw.mlp_out_norm)


class Gemma3Model(DecoderModel):
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
        self.global_rope = Rope(arch, dtype, device)
        self.local_rope = Rope(arch, dtype, device, local=True)
        self.scale = arch.attention_scale
        # HF multiplies by the scale as a tensor of the embedding's dtype
        self.embed_scale = torch.tensor(arch.hidden_size**0.5, dtype=dtype).item()
        self.windows = tuple(arch.window(i) for i in range(arch.num_layers))
        self.norms = tuple(GemmaNorms.of(i, lw) for i, lw in enumerate(self.layers))
        self.ropes = tuple(self.global_rope if w is None else self.local_rope for w in self.windows)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.embed_scale

    def _rotated(
        self, qkv: torch.Tensor, positions: torch.Tensor, norms: GemmaNorms, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """QK-norm of the query and key heads of ``qkv`` (in place), then RoPE."""
        a, ops, d = self.arch, self.ops, self.arch.head_dim
        ops.head_rms_norm_(qkv, a.num_heads, d, norms.q, a.rms_norm_eps)
        ops.head_rms_norm_(qkv[:, a.num_heads * d :], a.num_kv_heads, d, norms.k, a.rms_norm_eps)
        return ops.rotary(qkv, positions, rope, a.num_heads, a.num_kv_heads)

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
        h = self.embed_tokens(input_ids)
        sampled_only = False  # the last layer past its K/V writes: the sampled rows only
        for idx, lw in enumerate(self.layers):
            window, rope, norms = self.windows[idx], self.ropes[idx], self.norms[idx]
            x = ops.rms_norm(h, lw.input_norm, eps)
            qkv = self.gemm(x, lw.qkv)
            q, k = self._rotated(qkv, positions, norms, rope)
            v = qkv[:, q_dim + kv_dim :].view(n, a.num_kv_heads, a.head_dim)
            k_pool, v_pool = kv.layer(idx)
            slots = meta.for_group(kv.group_of(idx))  # a sliding layer: its window parts
            write_kv(k_pool, v_pool, k, v, slots, attention.decode)
            if on_layer is not None:
                on_layer(idx)
            if idx + 1 == len(self.layers) and slots.sampled is not None:
                slots, n, sampled_only = slots.sampled, logits_rows.shape[0], True
                if n == 0:
                    return self.no_logits()
                q, k, v, h = q[logits_rows], k[logits_rows], v[logits_rows], h[logits_rows]
            attn = paged_attention(q, k, v, k_pool, v_pool, slots, self.scale, attention, window)
            o = self.gemm(attn.reshape(n, q_dim), lw.o_proj)
            h = h + ops.rms_norm(o, norms.attn_out, eps)
            x = ops.rms_norm(h, lw.post_norm, eps)
            mlp = self.gemm(self.gemm.glu(x, lw.gate_up, "gelu_tanh", ops), lw.down)
            h = h + ops.rms_norm(mlp, norms.mlp_out, eps)
        last = ops.rms_norm(h if sampled_only else h[logits_rows], self.final_norm, eps)
        return self.gemm(last, self.lm_head).float()
