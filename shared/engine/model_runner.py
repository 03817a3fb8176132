"""Turns a scheduled step into tensors, runs the model over the paged KV pool, samples."""

from __future__ import annotations

import torch

from shared.engine.request import RequestId, SampledToken
from shared.engine.sampler import SamplingRow, sample
from shared.engine.scheduler import ScheduledRequest, SchedulerOutput
from shared.kv.kv_cache import KVCache
from shared.model.attention import AttentionMetadata, DecodeBatch, PrefillSegment
from shared.model.llama import LlamaModel


class ModelRunner:
    """Owns the model weights' use and the KV pool tensors of one engine."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.device = model.device

    def execute(self, step: SchedulerOutput) -> dict[RequestId, SampledToken]:
        decodes = [s for s in step.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in step.scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        segments: list[PrefillSegment] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        bs = self.block_size
        for s in ordered:
            req = s.request
            start = req.num_computed_tokens
            row0 = len(ids)
            for pos in range(start, start + s.num_new_tokens):
                ids.append(req.token_at(pos))
                positions.append(pos)
                slot_blocks.append(req.block_ids[pos // bs])
                slot_offsets.append(pos % bs)
            if s.num_new_tokens > 1:
                ctx = start + s.num_new_tokens
                table = torch.tensor(req.block_ids[: -(-ctx // bs)], device=self.device)
                segments.append(PrefillSegment(row0, len(ids), table, ctx))
            if s.samples:
                logits_rows.append(len(ids) - 1)
                sampled.append(s)
        decode = None
        if decodes:
            decode = DecodeBatch.build(
                [list(s.request.block_ids) for s in decodes],
                [s.request.num_computed_tokens + 1 for s in decodes],
                bs,
                self.device,
            )
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, device=self.device),
            slot_offsets=torch.tensor(slot_offsets, device=self.device),
            num_decodes=len(decodes),
            decode=decode,
            prefills=tuple(segments),
        )
        logits = self.model.forward(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
            self.kv_cache,
            torch.tensor(logits_rows, dtype=torch.long, device=self.device),
        )
        if not sampled:
            return {}
        rows = [
            SamplingRow(
                s.request.params, s.request.seed, s.request.num_tokens, s.request.output_token_ids
            )
            for s in sampled
        ]
        tokens = sample(logits, rows)
        return {s.request.request_id: t for s, t in zip(sampled, tokens, strict=True)}
