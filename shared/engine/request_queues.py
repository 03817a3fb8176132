"""Where each request of a scheduler is, and the moves between those places."""

from __future__ import annotations

from collections import deque

from shared.engine.request import Request, RequestId, RequestStatus
from shared.errors import InvalidRequestError


class RequestQueues:
    """The requests one :class:`~shared.engine.scheduler.Scheduler` holds, by place:

    - ``waiting``: arrival order; a preempted request, or one whose KV just loaded,
      goes back to the front;
    - ``running``: computed in the next step, in admission order (the scheduler
      preempts from the end);
    - ``parked``: prefilled elsewhere and waiting for their first token, with nothing
      to compute before it comes;
    - ``releasing``: finished, their slots held until the connector lets go of them.

    ``requests`` holds every unfinished request by id; one loading KV asynchronously
    is in none of the places above (:class:`~shared.engine.kv_loads.KVLoads` has it).
    Bookkeeping only: which request moves where is the scheduler's decision.
    """

    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: dict[RequestId, Request] = {}
        self.releasing: dict[RequestId, Request] = {}
        self.requests: dict[RequestId, Request] = {}

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id {req.request_id} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def run(self, req: Request) -> None:
        """A waiting request computes from the next step on."""
        self.waiting.remove(req)  # by identity (Request compares by identity)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def park(self, req: Request) -> None:
        """The request at the head of the queue has nothing to compute before its
        first token arrives."""
        self.waiting.popleft()
        self.parked[req.request_id] = req

    def unpark(self, request_id: RequestId) -> None:
        """Its first token came: it waits at the front of the queue."""
        req = self.parked.pop(request_id, None)
        if req is not None:
            self.waiting.appendleft(req)

    def requeue(self, req: Request) -> None:
        """Back to the front of the queue (parked while it still awaits its first token)."""
        req.status = RequestStatus.WAITING
        if req.awaiting_first_token:
            self.parked[req.request_id] = req
        else:
            self.waiting.appendleft(req)

    def remove(self, request_id: RequestId) -> Request | None:
        """Take an unfinished request out of every place; None for an unknown id."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.parked.pop(request_id, None)
        return req

    def holders(self) -> int:
        """Requests holding slots (running, loading, or loaded and waiting)."""
        return sum(1 for r in self.requests.values() if r.slots)

    def idle_holders(self) -> list[Request]:
        """Waiting requests holding slots (their KV was loaded), in queue order."""
        return [r for r in self.waiting if r.slots]

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.releasing)
