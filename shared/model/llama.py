"""A Llama-family decoder in plain torch (RMSNorm, RoPE, GQA, SwiGLU) over a paged KV pool.

The model holds only its weights (engines may share one model); the caller
passes the flattened ragged batch, the attention metadata, the KV pool and the
attention implementations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.errors import ModelFormatError
from shared.kv.kv_cache import KVCache
from shared.model.arch import LlamaArch
from shared.model.attention import AttentionMetadata, paged_attention, write_kv
from shared.model.attention_impl import AttentionImpl
from shared.model.linear import Linear, PackedWeight
from shared.model.pointwise import Pointwise
from shared.model.rope import Rope


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    # the GEMM weights are as the model's Linear packed them
    qkv: PackedWeight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o_proj: PackedWeight
    post_norm: torch.Tensor
    gate_up: PackedWeight  # [2 * intermediate, hidden]
    down: PackedWeight


@dataclass(frozen=True)
class ModelWeights:
    """What a model keeps of its checkpoint: norms dense, GEMM weights as its
    :class:`Linear` packed them. Read-only for the model's lifetime, so one copy
    (e.g. a file mapped by every process on the host) can serve many models."""

    embed: torch.Tensor | None  # None: tied, looked up in lm_head's packed rows
    final_norm: torch.Tensor
    lm_head: PackedWeight
    layers: tuple[LayerWeights, ...]


def pack_weights(
    arch: LlamaArch,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str,
    linear: Linear,
) -> ModelWeights:
    """``state`` (HF tensor names) -> :class:`ModelWeights` in ``dtype`` on ``device``."""

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ModelFormatError(f"weights lack tensor {name}")
        t = state[name].to(dtype=dtype, device=device)
        # safetensors payloads can start at any byte offset; BLAS kernels run
        # ~25% slower on weights that are not 64-byte aligned, so copy those.
        return t.clone() if t.data_ptr() % 64 else t

    def expect(t: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
        if tuple(t.shape) != shape:
            raise ModelFormatError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        return t

    a = arch
    q_dim, kv_dim = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    embed = expect(get("model.embed_tokens.weight"), (a.vocab_size, a.hidden_size), "embed_tokens")
    # tied: the head is the packed embedding, and where the backend can read rows
    # back from its packing, lookups use it too (no second, dense copy)
    lm_head = linear.pack(embed if a.tie_word_embeddings else get("lm_head.weight"))
    layers = []
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        q = expect(get(p + "self_attn.q_proj.weight"), (q_dim, a.hidden_size), p + "q_proj")
        k = expect(get(p + "self_attn.k_proj.weight"), (kv_dim, a.hidden_size), p + "k_proj")
        v = expect(get(p + "self_attn.v_proj.weight"), (kv_dim, a.hidden_size), p + "v_proj")
        gate = get(p + "mlp.gate_proj.weight")
        up = get(p + "mlp.up_proj.weight")
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=linear.pack(torch.cat([q, k, v])),
                o_proj=linear.pack(get(p + "self_attn.o_proj.weight")),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=linear.pack(torch.cat([gate, up])),
                down=linear.pack(get(p + "mlp.down_proj.weight")),
            )
        )
    return ModelWeights(
        embed=None if a.tie_word_embeddings and linear.reads_rows else embed,
        final_norm=get("model.norm.weight"),
        lm_head=lm_head,
        layers=tuple(layers),
    )


class LlamaModel:
    def __init__(
        self,
        arch: LlamaArch,
        weights: ModelWeights,
        dtype: torch.dtype,
        device: str,
        linear: Linear,
        pointwise: Pointwise,
    ):
        if weights.embed is None and not linear.reads_rows:
            raise ModelFormatError(
                f"the weights keep no dense embedding and the {linear.name} linear "
                "backend cannot read one from the packed head"
            )
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.weights = weights
        self.embed = weights.embed
        self.final_norm = weights.final_norm
        self.lm_head = weights.lm_head
        self.layers = weights.layers
        self.gemm = linear
        self.ops = pointwise
        self.rope = Rope(arch, dtype, device)
        self.scale = arch.head_dim**-0.5

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            return self.gemm.rows(self.lm_head, input_ids)
        return F.embedding(input_ids, self.embed)

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
        """Run the batch; returns fp32 logits ``[len(logits_rows), vocab]`` of the chosen rows.

        ``on_layer(i)`` is called once layer ``i``'s K/V of this batch are in
        the pool (final: nothing later in this forward writes them again), so
        a caller can ship that layer while the next ones compute.
        """
        a = self.arch
        q_dim, kv_dim = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        n = input_ids.shape[0]
        ops, eps = self.ops, a.rms_norm_eps
        h = self.embed_tokens(input_ids)
        for idx, lw in enumerate(self.layers):
            x = ops.rms_norm(h, lw.input_norm, eps)
            qkv = self.gemm(x, lw.qkv)
            q, k = ops.rotary(qkv, positions, self.rope, a.num_heads, a.num_kv_heads)
            v = qkv[:, q_dim + kv_dim :].view(n, a.num_kv_heads, a.head_dim)
            k_pool, v_pool = kv.layer(idx)
            write_kv(k_pool, v_pool, k, v, meta, attention.decode)
            if on_layer is not None:
                on_layer(idx)
            attn = paged_attention(q, k, v, k_pool, v_pool, meta, self.scale, attention)
            h = h + self.gemm(attn.reshape(n, q_dim), lw.o_proj)
            x = ops.rms_norm(h, lw.post_norm, eps)
            h = h + self.gemm(ops.silu_mul(self.gemm(x, lw.gate_up)), lw.down)
        last = ops.rms_norm(h[logits_rows], self.final_norm, eps)
        return self.gemm(last, self.lm_head).float()
