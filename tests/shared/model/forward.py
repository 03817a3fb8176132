"""Test helper: run prompts straight through the model over a private KV pool."""

from __future__ import annotations

from dataclasses import replace

import torch

from shared.config import EngineConfig
from shared.engine.model_runner import prefill_runs
from shared.kv.kv_cache import KVCache
from shared.kv.layout import KVLayout
from shared.model.attention import (
    AttentionMetadata,
    DecodeBatch,
    DecodeGroup,
    PrefillSegment,
    sampled_rows,
)
from shared.model.attention_impl import AttentionImpl, select_attention
from shared.model.loader import LoadedModel

BLOCK = 16


def new_cache(loaded: LoadedModel, num_blocks: int = 64) -> KVCache:
    a = loaded.arch
    dtype = "bfloat16" if loaded.model.dtype is torch.bfloat16 else "float32"
    return KVCache(KVLayout(a.num_layers, a.num_kv_heads, a.head_dim, BLOCK, dtype), num_blocks)


def prefill_logits(
    loaded: LoadedModel,
    ids: list[int],
    *,
    start: int = 0,
    cache: KVCache | None = None,
    blocks: list[int] | None = None,
    attention: AttentionImpl | None = None,
    last_only: bool = False,
    none: bool = False,
) -> torch.Tensor:
    """Logits of every row of ``ids[start:]``, computed on top of KV already at ``[0, start)``;
    ``last_only``: of the last row alone, the last layer computing that row only (as an
    engine's step samples a prompt); ``none``: of no row, the last layer computing none
    past its K/V writes (as a step computes a prompt's chunk before its last)."""
    cache = cache or new_cache(loaded)
    blocks = blocks or list(range(-(-len(ids) // BLOCK)))
    pos = torch.arange(start, len(ids))
    n = len(ids) - start
    meta = AttentionMetadata(
        slot_blocks=torch.empty(0, dtype=torch.long),
        slot_offsets=torch.empty(0, dtype=torch.long),
        slot_runs=tuple(prefill_runs(0, start, len(ids), blocks, BLOCK)),
        num_decodes=0,
        decode=(),
        prefills=(PrefillSegment(0, n, torch.tensor(blocks[: -(-len(ids) // BLOCK)]), len(ids)),),
    )
    rows = torch.arange(n)
    if last_only:
        table = meta.prefills[0].block_table.tolist()
        batch = DecodeBatch.build([table], [len(ids)], BLOCK, "cpu")
        meta = replace(meta, sampled=sampled_rows([DecodeGroup(0, 1, batch)], "cpu"))
        rows = rows[-1:]
    if none:
        meta = replace(meta, sampled=sampled_rows([], "cpu"))
        rows = rows[:0]
    if attention is None:  # what an engine on this machine picks
        model = loaded.model
        attention = select_attention(
            "auto", model.dtype, loaded.arch.head_dim, model.device, EngineConfig().kernel_dir
        )  # fmt: skip
    return loaded.model.forward(torch.tensor(ids[start:]), pos, meta, cache, rows, attention)
