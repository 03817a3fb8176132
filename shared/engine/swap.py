"""Swapping: a preempted request's KV goes to host memory, or failing that stays in the
KV store, and comes back when it resumes.

When a running request needs a pool slot and none is free, the scheduler
preempts the latest-arrived request. Without swapping its KV is dropped and
recomputed when it resumes (a prefill of its whole context, prompt and
generated tokens). With a :class:`Swapper` the scheduler asks the
:class:`SwapCostModel` which is cheaper for this request: copying its blocks
out and back (bytes over the copy bandwidth measured on this machine) or
recomputing them (tokens over the compute rate measured on this engine's
steps). A swap needs host blocks free; when there are too few (or there is no
host swap space), the request *spills*: the scheduler asks the KV connector to
keep its KV, which a decode instance that replicates already has in the store
up to the request's watermark (the connector stages the blocks not yet sent
before the slots go), and when the request is admitted again the connector
offers those blocks as a load; only the tail past the watermark is recomputed.
A connector that keeps nothing, or ``--preemption-mode recompute``, recomputes
everything (the prompt's blocks may still come back from the local prefix cache
or the KV store, as for any request).

Ownership: the :class:`Swapper` (pure Python, the scheduler's) decides and
keeps the host block free list; the scheduler's
:class:`~shared.engine.preemption.Preemption` plans the :class:`BlockCopy` lists
that leave with the step's output; the engine runs them on the
:class:`~shared.kv.host_swap.HostSwapSpace` before the step's forward. A slot a
copy-out reads may be handed to another request in the same step: the copy
runs before anything writes it. A step copies out or in, never both (a step
that preempts admits nothing), so a slot or host block freed in a step is not
refilled by a copy of the same step. Host blocks of a swapped request are free
again when it resumes or is aborted.

Output is unchanged: the blocks that come back hold the bytes that went out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NewType

from shared.engine.kv_cache_manager import Slot

HostBlock = NewType("HostBlock", int)

# one measurement moves an estimate this far (exponentially weighted mean)
EWMA_WEIGHT = 0.2
# a swap must be this much cheaper than recomputing to be chosen (estimates are noisy)
SWAP_MARGIN = 0.8
# steps with fewer tokens than this say little about the prefill rate
MIN_COMPUTE_TOKENS = 32


class PreemptionMode(Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class BlockCopy:
    """One pool slot's bytes between the pool and a host block of the slot's size (the
    direction is the list's)."""

    slot: Slot
    host: HostBlock


@dataclass(frozen=True)
class SwappedOut:
    """Where a preempted request's KV waits: its first ``num_tokens`` tokens' KV in
    ``host_blocks``, one per slot in the order the slots were given (with
    sliding-window layers: its blocks' slots, then the window parts' slots of its
    blocks from ``window_from`` on)."""

    host_blocks: tuple[HostBlock, ...]
    num_tokens: int
    window_from: int = 0


@dataclass
class SwapStats:
    swaps_out: int = 0
    swaps_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    spills_out: int = 0  # preemptions whose KV stayed in the store (host space full)
    spills_in: int = 0  # ... that resumed by loading it back
    spilled_tokens_in: int = 0  # generated tokens whose KV those loads brought back
    recomputes: int = 0  # preemptions that recomputed because that was cheaper
    recomputes_no_room: int = 0  # ... because the host space was full and nothing spilled


class SwapCostModel:
    """Swap or recompute, from what this machine measured. Before any copy was timed
    the copy bandwidth is ``prior_copy_bytes_s``; before any step of at least
    :data:`MIN_COMPUTE_TOKENS` tokens was, the compute rate is unknown and swapping
    (a memory copy) is taken to be cheaper."""

    def __init__(self, prior_copy_bytes_s: float = 2e9):
        self.copy_bytes_s = prior_copy_bytes_s
        self.compute_tokens_s: float | None = None

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.copy_bytes_s = _ewma(self.copy_bytes_s, nbytes / seconds)

    def observe_compute(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_COMPUTE_TOKENS and seconds > 0:
            rate = tokens / seconds
            prev = self.compute_tokens_s
            self.compute_tokens_s = rate if prev is None else _ewma(prev, rate)

    def swap_seconds(self, nbytes: int) -> float:
        return 2 * nbytes / self.copy_bytes_s  # out now, in later

    def recompute_seconds(self, tokens: int) -> float | None:
        rate = self.compute_tokens_s
        return None if rate is None else tokens / rate

    def choose(self, tokens: int, nbytes: int) -> PreemptionMode:
        recompute = self.recompute_seconds(tokens)
        if recompute is None or self.swap_seconds(nbytes) <= SWAP_MARGIN * recompute:
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE


class Swapper:
    """The scheduler's side of swapping: decisions and host block bookkeeping."""

    def __init__(
        self,
        num_host_blocks: int,
        block_bytes: int,
        cost: SwapCostModel,
        *,
        always: bool = False,  # swap whenever there is room, whatever the cost model says
    ):
        self.num_host_blocks = num_host_blocks
        self.always = always
        self.block_bytes = block_bytes
        self.cost = cost
        self.stats = SwapStats()
        self._free: list[HostBlock] = [HostBlock(i) for i in reversed(range(num_host_blocks))]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def swap_out(
        self, slots: list[Slot], num_tokens: int, window_from: int = 0
    ) -> tuple[SwappedOut, list[BlockCopy]]:
        """Copies that save ``slots`` (the request's first blocks, covering
        ``num_tokens``, then any window parts' slots) to host blocks; raises
        :class:`HostSwapFull` (which the scheduler answers with a spill, and counts)
        before asking the cost model, which prices only host copies, or
        :class:`CheaperToRecompute`."""
        if len(slots) > len(self._free):  # the next tier (the connector) decides for itself
            raise HostSwapFull("the host swap space is full")
        nbytes = len(slots) * self.block_bytes
        mode = PreemptionMode.SWAP if self.always else self.cost.choose(num_tokens, nbytes)
        if mode is PreemptionMode.RECOMPUTE:
            self.stats.recomputes += 1
            raise CheaperToRecompute("recomputing is cheaper")
        hosts = [self._free.pop() for _ in slots]
        self.stats.swaps_out += 1
        self.stats.bytes_out += nbytes
        copies = [BlockCopy(s, h) for s, h in zip(slots, hosts, strict=True)]
        return SwappedOut(tuple(hosts), num_tokens, window_from), copies

    def swap_in(self, swapped: SwappedOut, slots: Sequence[Slot | None]) -> list[BlockCopy]:
        """Copies that bring ``swapped`` back into ``slots`` (aligned with its host
        blocks; None: that one stays behind, a window part no row reads any more); its
        host blocks count as free from now on (nothing copies out in the step that runs
        these)."""
        if len(slots) != len(swapped.host_blocks):
            raise ValueError(f"{len(swapped.host_blocks)} host blocks into {len(slots)} slots")
        copies = [
            BlockCopy(s, h)
            for s, h in zip(slots, swapped.host_blocks, strict=True)
            if s is not None
        ]
        self.stats.swaps_in += 1
        self.stats.bytes_in += len(copies) * self.block_bytes
        self._free.extend(swapped.host_blocks)
        return copies

    def discard(self, swapped: SwappedOut) -> None:
        """A swapped-out request ended (aborted): its host blocks are free."""
        self._free.extend(swapped.host_blocks)


class NoSwap(Exception):
    """This preemption does not swap to host memory (the subclass says why)."""


class CheaperToRecompute(NoSwap):
    """The cost model found recomputing cheaper than copying out and back."""


class HostSwapFull(NoSwap):
    """Too few host blocks are free (or there is no host swap space)."""


@dataclass(frozen=True)
class SwapPlan:
    """A step's copies, pool to host (``copy_out``) or host to pool (``copy_in``)."""

    copy_out: tuple[BlockCopy, ...] = ()
    copy_in: tuple[BlockCopy, ...] = ()

    def __post_init__(self) -> None:
        if self.copy_out and self.copy_in:
            raise ValueError("a step copies out or in, never both")

    def __bool__(self) -> bool:
        return bool(self.copy_out or self.copy_in)


def _ewma(old: float, new: float) -> float:
    return (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new
