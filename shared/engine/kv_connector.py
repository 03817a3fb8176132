"""The KV connector: the one seam through which KV blocks enter and leave an engine.

Compare vLLM's ``KVConnectorBase_V1`` and SGLang's disaggregation ``conn.py``;
this one is smaller because the engine is one thread in one process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.engine.request import Request, RequestId

if TYPE_CHECKING:
    from shared.engine.kv_cache_manager import Slot
    from shared.engine.scheduler_output import SchedulerOutput
    from shared.kv.kv_cache import KVCache


@dataclass(frozen=True)
class ExternalHit:
    """Prompt tokens, after those held locally, whose KV the connector can load.

    ``asynchronous``: the load runs outside engine steps and the request waits
    for it (:meth:`KVConnector.poll` says when); otherwise the load runs inside
    the request's first step, layer by layer, overlapped with computing the
    tokens after it (:meth:`KVConnector.wait_for_layer`).
    """

    num_tokens: int = 0
    asynchronous: bool = False


NO_HIT = ExternalHit()


@dataclass(frozen=True)
class ConnectorEvents:
    """What finished outside the engine since the last :meth:`KVConnector.poll`."""

    loaded: frozenset[RequestId] = frozenset()  # asynchronous loads complete
    failed: frozenset[RequestId] = frozenset()  # asynchronous loads that failed
    released: frozenset[RequestId] = frozenset()  # finished requests whose slots it let go

    def __bool__(self) -> bool:
        return bool(self.loaded or self.failed or self.released)


class KVConnector(ABC):
    """Moves KV blocks between the engine's pool and the outside.

    Ownership: the engine's KV cache manager owns every slot; the connector
    never allocates, frees or maps one. It touches the bytes of slots the
    engine names, and only for as long as this contract says:

    - load: the slots given to :meth:`start_load` are written by the connector
      until the load ends. In-step loads end by the end of their step: layer
      ``i`` of them is safe to read once :meth:`wait_for_layer` ``(i)``
      returned. Asynchronous loads end when :meth:`poll` reports them
      ``loaded`` (safe to read) or ``failed`` (the bytes are garbage; the
      engine frees the slots and recomputes). A load of a request that
      finishes early ends when :meth:`poll` reports it ``released``.
    - save: the slots of the requests in a step are read by :meth:`save_layer`
      until :meth:`end_step` returns, or, where it deferred copies past the step's
      outputs, until :meth:`flush` returns; the engine calls it before anything
      reads or reuses a slot again. Slots of a request for which
      :meth:`request_finished` returned True are read until :meth:`poll`
      reports it ``released``; the engine keeps them until then. With
      sliding-window layers, a block's window part (see
      :mod:`shared.kv.layer_groups`) stays from :meth:`window_hold` on.

    Threads: every method runs on the engine thread. Only
    :meth:`wait_for_layer` and :meth:`end_step` block, and only as long as
    the data they guard needs (bounded by the connector's own timeouts);
    the rest return at once and leave the transfer work to other threads or
    an event loop.
    """

    pool: KVCache | None = None

    def bind(self, pool: KVCache) -> None:
        """The engine hands over its KV pool once, at construction: the bytes of the
        slots it names later live there."""
        self.pool = pool

    @abstractmethod
    def external_hit(self, request: Request, num_local_tokens: int) -> ExternalHit:
        """How many tokens after the first ``num_local_tokens`` (held locally) can be
        loaded from outside; a whole number of blocks, except that an asynchronous
        load may end at the prompt's partial tail."""

    @abstractmethod
    def start_load(self, request: Request, first_block: int, slots: Sequence[Slot]) -> None:
        """Load the request's blocks ``first_block, first_block + 1, ...`` into ``slots``."""

    @abstractmethod
    def wait_for_layer(self, layer: int) -> None:
        """Block until ``layer`` of every in-step load of this step is in the pool (or the
        load failed; :meth:`end_step` reports it)."""

    @abstractmethod
    def save_layer(self, layer: int, step: SchedulerOutput) -> None:
        """``layer``'s K/V of every token computed in ``step`` are final in the pool."""

    @abstractmethod
    def end_step(self) -> frozenset[RequestId]:
        """The step's forward is done: block until no save reads its slots any more.
        Returns the requests whose in-step load failed: their outputs of this step are
        garbage and the engine recomputes them."""

    def flush(self) -> None:
        """Make the copies out of the pool that the last step deferred past its outputs
        (none by default): the bytes a transfer sends only once the step's first token
        has left need not delay that token. The engine calls it before its next step
        schedules anything, and an engine loop as soon as the step's outputs are
        handed over."""
        return None

    @abstractmethod
    def request_finished(self, request: Request) -> bool:
        """The request ended (finished, aborted or failed). True: the connector still
        reads or writes its slots (a save or a load in flight); the engine keeps them
        until :meth:`poll` reports the request ``released``."""

    def window_hold(self, request: Request) -> int | None:
        """The first block of ``request`` whose window part the connector will still
        read from the pool after this step (its sliding layers, not yet sent); None:
        none. The engine keeps those parts even once no row reads them."""
        return None

    def spill(self, request: Request) -> bool:
        """The request is preempted and host swap space is full: keep what of its KV
        the connector can, so that resuming loads it instead of recomputing it. Its
        slots hold its computed KV during this call only (they are freed right after
        and the next forward may overwrite them). True: :meth:`external_hit` offers
        the kept KV when the request is admitted again (a failed load recomputes, as
        for any load). The default keeps nothing."""
        return False

    @abstractmethod
    def poll(self) -> ConnectorEvents:
        """Non-blocking: the asynchronous loads and releases that ended since the last
        call."""
