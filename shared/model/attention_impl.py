"""The attention implementations one model runner uses, chosen together from
one config value (``EngineConfig.attention``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shared.config import AttentionBackend
from shared.model.decode_attention import DecodeAttention, select_decode_attention
from shared.model.prefill_attention import PrefillAttention, select_prefill_attention


@dataclass(frozen=True)
class AttentionImpl:
    decode: DecodeAttention  # one new token per sequence (and its K/V writes)
    prefill: PrefillAttention  # a segment of new tokens over its context


def select_attention(
    backend: AttentionBackend,
    dtype: torch.dtype,
    head_dim: int,
    device: str,
    kernel_dir: Path,
    *,
    block_size: int = 16,
) -> AttentionImpl:
    return AttentionImpl(
        decode=select_decode_attention(
            backend, dtype, device, kernel_dir, head_dim=head_dim, block_size=block_size
        ),
        prefill=select_prefill_attention(
            backend, dtype, head_dim, device, kernel_dir, block_size=block_size
        ),
    )
