"""Turns a scheduled step into tensors, runs the model over the paged KV pool, samples."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from shared.engine.cuda_graphs import DecodeGraphs
from shared.engine.grammar_masks import MaskWorker
from shared.engine.request import RequestId, SampledToken
from shared.engine.sampler import SamplingRow, sample
from shared.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from shared.kv.kv_cache import KVCache
from shared.model.attention import (
    AttentionMetadata,
    BlockRun,
    DecodeBatch,
    DecodeGroup,
    PrefillSegment,
    SlotRun,
    group_by_width,
    sampled_rows,
    split_whole_blocks,
)
from shared.model.attention_impl import AttentionImpl
from shared.model.decoder import DecoderModel

LayerHook = Callable[[int, SchedulerOutput], None]
"""``hook(layer, step)``, on the engine thread, once ``layer``'s K/V of ``step``'s new
tokens are in the pool and before that layer's attention reads the pool."""


@dataclass(frozen=True)
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # rows whose logits are sampled
    sampled: tuple[ScheduledRequest, ...]  # in the order of logits_rows


def prefill_runs(row0: int, start: int, end: int, slots: Sequence[int], bs: int) -> list[SlotRun]:
    """Split positions ``[start, end)`` (rows from ``row0``) into per-block slice copies."""
    runs = []
    pos = start
    while pos < end:
        length = min(bs - pos % bs, end - pos)
        runs.append(SlotRun(row0 + pos - start, slots[pos // bs], pos % bs, length))
        pos += length
    return runs


def decode_groups(
    decodes: Sequence[ScheduledRequest],
    ctx: Sequence[int],
    block_size: int,
    device: str,
    split: bool,
) -> tuple[DecodeGroup, ...]:
    """The decode rows as one group, or (``split``) groups of similar block-table width."""
    widths = [-(-c // block_size) for c in ctx]
    groups, start = [], 0
    for end in group_by_width(widths) if split else ([len(widths)] if widths else []):
        tables = [s.request.slots for s in decodes[start:end]]
        batch = DecodeBatch.build(tables, ctx[start:end], block_size, device)
        groups.append(DecodeGroup(start, end, batch))
        start = end
    return tuple(groups)


def build_input(
    step: SchedulerOutput,
    block_size: int,
    device: str,
    *,
    split_decodes: bool = True,
    part_table: torch.Tensor | None = None,
) -> ModelInput:
    """Flatten a step: decode rows first (one token each), then each prefill segment.
    ``split_decodes``: group decode rows by context width (attention that pads them).
    ``part_table`` (``[slots, groups]``, a pool split by layer groups): each block's
    window part, from which the metadata's ``window_groups`` are translated."""
    # decode rows sorted by context length, so that rows of similar length share a group
    decodes = sorted(
        (s for s in step.scheduled if s.num_new_tokens == 1),
        key=lambda s: s.request.num_computed_tokens,
    )
    prefills = [s for s in step.scheduled if s.num_new_tokens > 1]
    ids: list[int] = []
    positions: list[int] = []
    rows: list[tuple[ScheduledRequest, int]] = []  # each prefill and its first row
    logits_rows: list[int] = []
    sampled: list[ScheduledRequest] = []
    for s in decodes + prefills:
        req = s.request
        start = req.num_computed_tokens
        end = start + s.num_new_tokens
        if s.num_new_tokens > 1:
            rows.append((s, len(ids)))
        ids.extend(req.token_at(pos) for pos in range(start, end))
        positions.extend(range(start, end))
        if s.samples:
            logits_rows.append(len(ids) - 1)
            sampled.append(s)
    ctx = [s.request.num_computed_tokens + 1 for s in decodes]
    meta = _metadata(decodes, rows, ctx, len(ids), block_size, device, split_decodes)
    if len(logits_rows) < len(ids):
        sampled_ctx = [s.request.num_computed_tokens + s.num_new_tokens for s in sampled]
        rows_alone = decode_groups(sampled, sampled_ctx, block_size, device, split_decodes)
        meta = replace(meta, sampled=sampled_rows(rows_alone, device))
    if part_table is not None and part_table.shape[1]:
        groups = tuple(_translated(meta, part_table[:, g]) for g in range(part_table.shape[1]))
        meta = replace(meta, window_groups=groups)
    return ModelInput(
        input_ids=torch.tensor(ids, device=device),
        positions=torch.tensor(positions, device=device),
        meta=meta,
        logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
        sampled=tuple(sampled),
    )


def _check_written_parts(step: SchedulerOutput, block_size: int, pool: KVCache) -> None:
    """Every block a step writes has its window part (the translated block tables give
    slot 0 to blocks without one, which may only be read past, never written)."""
    for s in step.scheduled:
        first = s.request.num_computed_tokens // block_size
        last = (s.request.num_computed_tokens + s.num_new_tokens - 1) // block_size
        for slot in s.request.slots[first : last + 1]:
            if pool.part_of(slot) is None:
                raise RuntimeError(f"{s.request.request_id}: block in slot {slot} has no part")


def _translated(meta: AttentionMetadata, part_of: torch.Tensor) -> AttentionMetadata:
    """``meta`` with every block's slot replaced by ``part_of[slot]`` (one sliding
    group's slot of its window part; 0 for blocks without one, whose keys no row weighs:
    the attention kernels may read them, as keys of probability +0, or as zeros)."""
    return AttentionMetadata(
        slot_blocks=part_of[meta.slot_blocks],
        slot_offsets=meta.slot_offsets,
        slot_runs=tuple(replace(r, block=int(part_of[r.block])) for r in meta.slot_runs),
        block_runs=tuple(BlockRun(r.row, part_of[r.blocks]) for r in meta.block_runs),
        row_blocks=None if meta.row_blocks is None else part_of[meta.row_blocks],
        row_offsets=meta.row_offsets,
        num_decodes=meta.num_decodes,
        decode=tuple(
            replace(g, batch=replace(g.batch, tables=part_of[g.batch.tables])) for g in meta.decode
        ),
        prefills=tuple(replace(p, block_table=part_of[p.block_table]) for p in meta.prefills),
        sampled=None if meta.sampled is None else _translated(meta.sampled, part_of),
    )


def _metadata(
    decodes: Sequence[ScheduledRequest],
    prefills: Sequence[tuple[ScheduledRequest, int]],
    ctx: Sequence[int],
    num_rows: int,
    block_size: int,
    device: str,
    split_decodes: bool,
) -> AttentionMetadata:
    """Where the step's rows write and read K/V (the slots of layer group 0)."""
    runs: list[SlotRun] = []
    segments: list[PrefillSegment] = []
    slot_blocks = torch.tensor(
        [s.request.slots[(c - 1) // block_size] for s, c in zip(decodes, ctx, strict=True)],
        dtype=torch.long,
        device=device,
    )
    slot_offsets = torch.tensor(
        [(c - 1) % block_size for c in ctx], dtype=torch.long, device=device
    )
    row_blocks, row_offsets = [slot_blocks], [slot_offsets]
    for i, (s, row0) in enumerate(prefills):
        req = s.request
        start = req.num_computed_tokens
        end = start + s.num_new_tokens
        table = req.slots
        runs.extend(prefill_runs(row0, start, end, table, block_size))
        row_end = prefills[i + 1][1] if i + 1 < len(prefills) else num_rows
        blocks = torch.tensor(table[: -(-end // block_size)], device=device)
        segments.append(PrefillSegment(row0, row_end, blocks, end))
        pos = torch.arange(start, end, device=device)
        row_blocks.append(blocks[pos // block_size])
        row_offsets.append(pos % block_size)
    partial, whole = split_whole_blocks(runs, block_size, device)
    return AttentionMetadata(
        slot_blocks=slot_blocks,
        slot_offsets=slot_offsets,
        slot_runs=tuple(partial),
        block_runs=tuple(whole),
        row_blocks=torch.cat(row_blocks) if prefills else slot_blocks,
        row_offsets=torch.cat(row_offsets) if prefills else slot_offsets,
        num_decodes=len(decodes),
        decode=decode_groups(decodes, ctx, block_size, device, split_decodes),
        prefills=tuple(segments),
    )


class ModelRunner:
    """Runs the model for one engine over its KV pool (which it owns for the engine's life).
    Decode-only steps replay CUDA graphs when ``graphs`` is given (see
    :mod:`shared.engine.cuda_graphs`); every other step runs eagerly."""

    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        attention: AttentionImpl,
        graphs: DecodeGraphs | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.graphs = graphs
        self.block_size = kv_cache.layout.block_size
        self.device = model.device
        self.masks = MaskWorker()

    def execute(
        self, step: SchedulerOutput, on_layer: LayerHook | None = None
    ) -> dict[RequestId, SampledToken]:
        # the grammars' masks are computed while the model runs (grammar_masks.py)
        pending = self.masks.start(
            {
                s.request.request_id: s.request.matcher
                for s in step.scheduled
                if s.samples and s.request.matcher is not None
            }
        )
        try:
            logits, sampled = self._replay(step, on_layer) or self._forward(step, on_layer)
        finally:
            masks = pending.result() if pending is not None else {}
        if not sampled:
            return {}
        rows = [
            SamplingRow(
                s.request.params,
                s.request.seed,
                s.request.num_tokens,
                s.request.output_token_ids,
                s.request.matcher,
                masks.get(s.request.request_id),
            )
            for s in sampled
        ]
        tokens = sample(logits, rows)
        return {s.request.request_id: t for s, t in zip(sampled, tokens, strict=True)}

    def _forward(
        self, step: SchedulerOutput, on_layer: LayerHook | None
    ) -> tuple[torch.Tensor, tuple[ScheduledRequest, ...]]:
        if self.kv_cache.windowed:
            _check_written_parts(step, self.block_size, self.kv_cache)
        inp = build_input(
            step,
            self.block_size,
            self.device,
            split_decodes=self.attention.decode.pads_to_width,
            part_table=self.kv_cache.part_table,
        )
        hook = None if on_layer is None else (lambda layer: on_layer(layer, step))
        logits = self.model.forward(
            inp.input_ids,
            inp.positions,
            inp.meta,
            self.kv_cache,
            inp.logits_rows,
            self.attention,
            hook,
        )
        return logits, inp.sampled

    def _replay(
        self, step: SchedulerOutput, on_layer: LayerHook | None
    ) -> tuple[torch.Tensor, tuple[ScheduledRequest, ...]] | None:
        """A decode-only step from its CUDA graph; None when it runs eagerly instead."""
        if self.graphs is None or not self.graphs.covers(step):
            return None
        logits = self.graphs.run(step)
        if logits is None:
            return None
        if on_layer is not None:
            # past its prompt a request never loads in-step (see DecodeGraphs.covers), so
            # the hooks only save: every layer of the step is final once replayed
            for layer in range(len(self.model.layers)):
                on_layer(layer, step)
        rows = [i for i, s in enumerate(step.scheduled) if s.samples]
        sampled = tuple(step.scheduled[i] for i in rows)
        if len(rows) != len(step.scheduled):
            logits = logits[torch.tensor(rows, device=logits.device)]
        return logits, sampled
