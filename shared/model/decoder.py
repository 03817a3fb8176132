"""What every decoder family shares: its weights as a model keeps them, and the model
boundary the runner calls (one forward over a ragged batch and a paged KV pool).

A family's module (:mod:`shared.model.llama`, :mod:`shared.model.gemma3`) packs a
checkpoint's tensors into :class:`ModelWeights` and runs them in its own
:meth:`DecoderModel.forward`; :mod:`shared.model.families` names the module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.errors import ModelFormatError
from shared.kv.kv_cache import KVCache
from shared.model.arch import ModelArch
from shared.model.attention import AttentionMetadata
from shared.model.attention_impl import AttentionImpl
from shared.model.linear import Linear, PackedWeight
from shared.model.pointwise import Pointwise


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # before attention
    # the GEMM weights are as the model's Linear packed them
    qkv: PackedWeight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o_proj: PackedWeight
    post_norm: torch.Tensor  # before the MLP
    gate_up: PackedWeight  # [2 * intermediate, hidden], packed by Linear.pack_glu
    down: PackedWeight
    # Gemma 3 only: RMSNorm of each query and key head, and of the attention's and
    # the MLP's outputs before their residual adds (None elsewhere)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class ModelWeights:
    """What a model keeps of its checkpoint: norms dense, GEMM weights as its
    :class:`Linear` packed them. Read-only for the model's lifetime, so one copy
    (e.g. a file mapped by every process on the host) can serve many models."""

    embed: torch.Tensor | None  # None: tied, looked up in lm_head's packed rows
    final_norm: torch.Tensor
    lm_head: PackedWeight
    layers: tuple[LayerWeights, ...]


class DecoderModel(ABC):
    """Weights plus the kernels that run them; holds no per-request state, so engines
    may share one. Subclasses implement one family's :meth:`forward`."""

    def __init__(
        self,
        arch: ModelArch,
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

    def no_logits(self) -> torch.Tensor:
        """The logits of a step that samples no row (a prompt's chunk before its last)."""
        return torch.empty(0, self.lm_head.out_features, device=self.device)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            return self.gemm.rows(self.lm_head, input_ids)
        return F.embedding(input_ids, self.embed)

    @abstractmethod
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
        Where ``meta.sampled`` is set, the last layer computes only those rows past its
        K/V writes (none at all when no row is chosen).

        ``on_layer(i)`` is called once layer ``i``'s K/V of this batch are in
        the pool (final: nothing later in this forward writes them again), so
        a caller can ship that layer while the next ones compute.
        """


def tensor_getter(
    state: dict[str, torch.Tensor], dtype: torch.dtype, device: str
) -> Callable[[str], torch.Tensor]:
    """``get(name)``: the checkpoint tensor ``name`` in ``dtype`` on ``device``."""

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ModelFormatError(f"weights lack tensor {name}")
        t = state[name].to(dtype=dtype, device=device)
        # safetensors payloads can start at any byte offset; BLAS kernels run
        # ~25% slower on weights that are not 64-byte aligned, so copy those.
        return t.clone() if t.data_ptr() % 64 else t

    return get


def expect(t: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ModelFormatError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
    return t


@dataclass(frozen=True)
class Projections:
    """One layer's GEMM weights, packed: every family names them as HF's Llama does."""

    qkv: PackedWeight
    o_proj: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight


def pack_projections(
    arch: ModelArch, get: Callable[[str], torch.Tensor], linear: Linear, prefix: str
) -> Projections:
    """Layer ``prefix``'s attention and MLP weights, Q/K/V and gate/up fused."""
    a, p = arch, prefix
    q_dim, kv_dim = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    q = expect(get(p + "self_attn.q_proj.weight"), (q_dim, a.hidden_size), p + "q_proj")
    k = expect(get(p + "self_attn.k_proj.weight"), (kv_dim, a.hidden_size), p + "k_proj")
    v = expect(get(p + "self_attn.v_proj.weight"), (kv_dim, a.hidden_size), p + "v_proj")
    gate = get(p + "mlp.gate_proj.weight")
    up = get(p + "mlp.up_proj.weight")
    return Projections(
        qkv=linear.pack(torch.cat([q, k, v])),
        o_proj=linear.pack(get(p + "self_attn.o_proj.weight")),
        gate_up=linear.pack_glu(gate, up),
        down=linear.pack(get(p + "mlp.down_proj.weight")),
    )


def pack_embedding(
    arch: ModelArch, get: Callable[[str], torch.Tensor], linear: Linear
) -> tuple[torch.Tensor | None, PackedWeight]:
    """The dense embedding a model keeps (None where it is read from the packed head)
    and the packed LM head."""
    a = arch
    embed = expect(get("model.embed_tokens.weight"), (a.vocab_size, a.hidden_size), "embed_tokens")
    # tied: the head is the packed embedding, and where the backend can read rows
    # back from its packing, lookups use it too (no second, dense copy)
    lm_head = linear.pack(embed if a.tie_word_embeddings else get("lm_head.weight"))
    return (None if a.tie_word_embeddings and linear.reads_rows else embed), lm_head
