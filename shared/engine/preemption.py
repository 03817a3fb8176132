"""What becomes of a preempted request's KV: swapped to host memory, spilled to the KV
connector, or dropped to be recomputed (see :mod:`shared.engine.swap`).

Ownership: the :class:`Preemption` is the scheduler's. When the scheduler preempts
a request its slots still hold the request's KV; :meth:`Preemption.evict` decides
what survives and plans the copies out, and the scheduler frees the slots right
after (a copy-out runs before the next forward, so a slot it reads is still intact
even if the same step hands it to another request). When a swapped request is
admitted again the scheduler gives it fresh slots and :meth:`swap_in` plans the
copies back; a spilled one loads its KV through the connector like any cache hit,
and :meth:`resumed` counts what of it came back past the prompt. The planned copies
leave with the step's output (:meth:`take_plan`).
"""

from __future__ import annotations

from collections.abc import Callable

from shared.engine.kv_cache_manager import Slot, WindowPart, cdiv
from shared.engine.kv_connector import KVConnector
from shared.engine.request import Request, RequestId
from shared.engine.swap import BlockCopy, CheaperToRecompute, HostSwapFull, Swapper, SwapPlan


class Preemption:
    def __init__(
        self,
        swapper: Swapper | None,
        connector: KVConnector | None,
        block_size: int,
        window_part: Callable[[Slot], WindowPart | None] | None = None,
    ):
        """``window_part``: a slot's window part now (a pool with sliding-window layers)."""
        self.swapper = swapper
        self.connector = connector
        self.block_size = block_size
        self.window_part = window_part
        self.num_preemptions = 0  # swapped, spilled or recomputed
        self._copy_out: list[BlockCopy] = []
        self._copy_in: list[BlockCopy] = []
        self._spill_loads: dict[RequestId, int] = {}  # spilled tokens an ongoing load brings back

    def evict(self, req: Request) -> None:
        """``req`` is preempted while its slots still hold its KV: swap it out, spill it,
        or start it over (``num_computed_tokens`` back to 0)."""
        self.num_preemptions += 1
        if not self._swap_out(req):
            req.num_computed_tokens = 0

    def _swap_out(self, req: Request) -> bool:
        """Copy the request's computed blocks to host memory if that is cheaper than
        recomputing them and there is room; False: it starts over, after a spill to the
        connector when the host space was full."""
        n = req.num_computed_tokens
        if self.swapper is None or n == 0:
            return False
        blocks = req.slots[: cdiv(n, self.block_size)]
        window_from = min(req.window_from, len(blocks)) if self.window_part else 0
        try:
            swapped, copies = self.swapper.swap_out(
                [*blocks, *self._part_slots(blocks[window_from:])], n, window_from
            )
        except CheaperToRecompute:
            return False
        except HostSwapFull:
            stats = self.swapper.stats
            req.spilled = self.connector is not None and self.connector.spill(req)
            if req.spilled:
                stats.spills_out += 1
            else:
                stats.recomputes_no_room += 1
            return False
        req.swapped = swapped
        self._copy_out.extend(copies)
        return True

    def _part_slots(self, blocks: list[Slot]) -> list[Slot]:
        """The slots of the window parts of ``blocks`` (which hold them), in order."""
        if self.window_part is None:
            return []
        out: list[Slot] = []
        for slot in blocks:
            part = self.window_part(slot)
            if part is None:
                raise RuntimeError(f"the block in slot {slot} has no window part")
            out.extend(part)
        return out

    def swap_in(self, req: Request, slots: list[Slot]) -> None:
        """Plan the copies of a swapped-out request's blocks into its fresh ``slots``
        (and window parts: those it holds again, from ``req.window_from`` on)."""
        swapped = req.swapped
        if swapped is None or self.swapper is None:
            raise RuntimeError(f"{req.request_id} has nothing swapped out")
        n = len(swapped.host_blocks)
        blocks = slots[: cdiv(swapped.num_tokens, self.block_size)]
        targets: list[Slot | None] = list(blocks)
        if self.window_part is not None and len(blocks) > swapped.window_from:
            # the parts that went out: from the first block the row computed last read.
            # A part it holds before that (its new window starts one row back) is never
            # read: the rows computed from here on read from the swapped ones on
            size = (n - len(blocks)) // (len(blocks) - swapped.window_from)
            for i in range(swapped.window_from, len(blocks)):
                part = self.window_part(blocks[i]) if i >= req.window_from else None
                targets.extend(part if part is not None else [None] * size)
        self._copy_in.extend(self.swapper.swap_in(swapped, targets))
        req.swapped = None

    def resumed(self, req: Request, local: int, computed: int, *, pending: bool) -> None:
        """A request is admitted with ``computed`` tokens' KV, ``local`` of them from the
        local pool; if it had spilled, what the connector brings back past the prompt
        counts as spilled KV coming in (once its load ends, when ``pending``)."""
        if not req.spilled:
            return
        req.spilled = False
        back = max(0, computed - max(local, req.num_prompt_tokens))
        if not back:  # nothing past the prompt came back: it recomputes those tokens
            return
        if pending:
            self._spill_loads[req.request_id] = back
        else:
            self._spilled_in(back)

    def load_ended(self, request_id: RequestId, *, ok: bool) -> None:
        """An asynchronous load ended (or failed, or its request finished)."""
        back = self._spill_loads.pop(request_id, 0)
        if ok and back:
            self._spilled_in(back)

    def _spilled_in(self, tokens: int) -> None:
        if self.swapper is not None:
            self.swapper.stats.spills_in += 1
            self.swapper.stats.spilled_tokens_in += tokens

    def discard(self, req: Request) -> None:
        """``req`` finished: its host blocks are free again, its pending count dropped."""
        if req.swapped is not None and self.swapper is not None:
            self.swapper.discard(req.swapped)
        req.swapped = None
        self.load_ended(req.request_id, ok=False)

    def take_plan(self) -> SwapPlan:
        """The copies planned since the last call, to run before the next forward."""
        plan = SwapPlan(tuple(self._copy_out), tuple(self._copy_in))
        self._copy_out.clear()
        self._copy_in.clear()
        return plan
