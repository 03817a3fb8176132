"""Decode steps replayed from CUDA graphs.

A decode step of a small model is hundreds of short kernels; launching them one by one
from Python takes far longer than running them. :class:`DecodeGraphs` captures the
model's forward for decode-only steps once per batch *bucket* (1, 2, 4, 8, ...) over
static input buffers, and replays it: each step only fills the buffers (one copy from
pinned memory) and launches the graph. A batch is padded up to its bucket with rows
that compute on a scratch slot no request owns; their outputs are ignored. Padding does
not change the real rows: the CUDA kernels' rows are batch-invariant, so a replay gives
the bits an eager step gives.

Ownership: the model runner owns it and calls it on the engine thread only. The scratch
slot is the pool's last block, which the engine keeps out of its KV cache manager.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shared.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from shared.kv.kv_cache import KVCache
from shared.model.attention import AttentionMetadata, DecodeBatch, DecodeGroup
from shared.model.attention_impl import AttentionImpl
from shared.model.decode_attention import TritonDecode
from shared.model.decoder import DecoderModel

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_for(batch: int, largest: int) -> int | None:
    """The smallest bucket holding ``batch`` rows, None past ``largest``."""
    return next((b for b in BUCKETS if b >= batch and b <= largest), None)


@dataclass(frozen=True)
class DecodeRows:
    """The host side of one decode step, rows in ``scheduled`` order, padded to the
    bucket: what the static buffers receive."""

    ids: list[int]
    positions: list[int]
    slot_blocks: list[int]
    slot_offsets: list[int]
    tables: list[list[int]]  # each row's slots up to its context

    @classmethod
    def of(
        cls, scheduled: Sequence[ScheduledRequest], bucket: int, block_size: int, scratch: int
    ) -> DecodeRows:
        rows = cls([], [], [], [], [])
        for s in scheduled:
            req = s.request
            pos = req.num_computed_tokens
            rows.ids.append(req.token_at(pos))
            rows.positions.append(pos)
            rows.slot_blocks.append(req.slots[pos // block_size])
            rows.slot_offsets.append(pos % block_size)
            rows.tables.append(list(req.slots[: pos // block_size + 1]))
        for _ in range(bucket - len(scheduled)):  # padding: one token on the scratch slot
            rows.ids.append(0)
            rows.positions.append(0)
            rows.slot_blocks.append(scratch)
            rows.slot_offsets.append(0)
            rows.tables.append([scratch])
        return rows


class _Graph:
    """One bucket's captured forward and the static buffers it reads and writes."""

    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor):
        self.graph = graph
        self.logits = logits


class DecodeGraphs:
    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        attention: AttentionImpl,
        *,
        max_batch: int,
        max_model_len: int,
        scratch_slot: int,
    ):
        if not isinstance(attention.decode, TritonDecode):
            raise ValueError("decode graphs need the Triton decode attention")
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.decode: TritonDecode = attention.decode
        self.block_size = kv_cache.layout.block_size
        self.scratch = scratch_slot
        # steps of more rows than the largest bucket run eagerly
        self.largest = bucket_for(min(max(1, max_batch), BUCKETS[-1]), BUCKETS[-1]) or 1
        self.width = -(-max_model_len // self.block_size)
        device, n = model.device, self.largest

        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        self.ids, self.positions = zeros(torch.int64), zeros(torch.int64)
        self.slot_blocks, self.slot_offsets = zeros(torch.int64), zeros(torch.int64)
        self.tables = torch.full((n, self.width), scratch_slot, dtype=torch.int32, device=device)
        self.tile_rows = torch.arange(n, dtype=torch.int32, device=device)
        self.tile_counts = torch.ones(n, dtype=torch.int32, device=device)
        self.tile_pos = zeros(torch.int32)
        self.logits_rows = torch.arange(n, dtype=torch.int64, device=device)
        # host staging of one step's inputs (ids, positions, slot blocks, slot offsets;
        # the block tables), rewritten only once the last step's copies are done
        self._host64 = torch.zeros((4, n), dtype=torch.int64, pin_memory=True)
        self._host_tables = torch.full(
            (n, self.width), scratch_slot, dtype=torch.int32, pin_memory=True
        )
        self._copied: torch.cuda.Event | None = None
        self._graphs: dict[int, _Graph] = {}
        self._pool: Any = None  # the memory pool every bucket's graph shares
        self.disabled = False

    @property
    def captured(self) -> frozenset[int]:
        """The buckets whose graphs exist."""
        return frozenset(self._graphs)

    def covers(self, step: SchedulerOutput) -> bool:
        """Whether this step replays a graph: within the buckets, and every row one token
        of a request past its prompt (a prompt's own one-token step may load KV inside
        the step, which the engine must wait for layer by layer)."""
        if self.disabled or not step.scheduled:
            return False
        if any(
            s.num_new_tokens != 1 or s.request.num_computed_tokens < s.request.num_prompt_tokens
            for s in step.scheduled
        ):
            return False
        return bucket_for(len(step.scheduled), self.largest) is not None

    def run(self, step: SchedulerOutput) -> torch.Tensor | None:
        """fp32 logits ``[len(step.scheduled), vocab]``, rows in ``step.scheduled`` order;
        None when this bucket's graph cannot be captured (graphs are then off and the
        caller runs the step eagerly)."""
        b = len(step.scheduled)
        bucket = bucket_for(b, self.largest)
        if bucket is None:
            raise ValueError(f"a decode step of {b} rows is past the largest graph")
        self._fill(DecodeRows.of(step.scheduled, bucket, self.block_size, self.scratch), bucket)
        graph = self._graphs.get(bucket)
        if graph is None:
            try:
                graph = self._capture(bucket)
            except RuntimeError:
                log.exception("capturing the decode step as a CUDA graph failed; running eagerly")
                self.disabled = True
                return None
        graph.graph.replay()
        return graph.logits[:b]

    def _fill(self, rows: DecodeRows, bucket: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies (long done, in practice)
        host = self._host64.numpy()
        for i, values in enumerate((rows.ids, rows.positions, rows.slot_blocks, rows.slot_offsets)):
            host[i, :bucket] = values
        tables = self._host_tables.numpy()
        for i, table in enumerate(rows.tables):
            tables[i, : len(table)] = table
        width = max(len(t) for t in rows.tables)
        for dst, src in zip(
            (self.ids, self.positions, self.slot_blocks, self.slot_offsets),
            self._host64,
            strict=True,
        ):
            dst[:bucket].copy_(src[:bucket], non_blocking=True)
        self.tables[:bucket, :width].copy_(self._host_tables[:bucket, :width], non_blocking=True)
        self.tile_pos[:bucket].copy_(self.positions[:bucket])
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.model.device))

    def _inputs(self, bucket: int) -> tuple[AttentionMetadata, DecodeBatch]:
        batch = DecodeBatch(
            tables=self.tables[:bucket],
            lens=self.positions[:bucket] + 1,
            mask=torch.empty(0, dtype=torch.bool, device=self.model.device),
        )
        meta = AttentionMetadata(
            slot_blocks=self.slot_blocks[:bucket],
            slot_offsets=self.slot_offsets[:bucket],
            slot_runs=(),
            num_decodes=bucket,
            decode=(DecodeGroup(0, bucket, batch),),
            prefills=(),
        )
        return meta, batch

    def _forward(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.forward(
            self.ids[:bucket],
            self.positions[:bucket],
            meta,
            self.kv_cache,
            self.logits_rows[:bucket],
            self.attention,
        )

    def _capture(self, bucket: int) -> _Graph:
        from shared.kernels.triton_attention import Tiles

        meta, batch = self._inputs(bucket)
        tiles = Tiles(
            row=self.tile_rows[:bucket],
            count=self.tile_counts[:bucket],
            pos=self.tile_pos[:bucket],
            seq=self.tile_rows[:bucket],
        )
        self.decode.bind(batch, tiles, self.tables[:bucket])
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compile and warm the kernels of this shape outside capture
                self._forward(bucket, meta)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(bucket, meta)
        self._pool = graph.pool()
        captured = _Graph(graph, logits)
        self._graphs[bucket] = captured
        log.info("captured the decode step of %d rows as a CUDA graph", bucket)
        return captured
