"""Where requests are: the scheduler's bookkeeping on its own (no KV pool, no model)."""

from __future__ import annotations

import pytest

from shared.engine.kv_cache_manager import Slot
from shared.engine.request import RequestStatus
from shared.engine.request_queues import RequestQueues
from shared.errors import InvalidRequestError
from tests.shared.engine.stepping import req


def test_a_request_id_is_used_once() -> None:
    q = RequestQueues()
    a = req(4)
    q.add(a)
    twin = req(4)
    twin.request_id = a.request_id
    with pytest.raises(InvalidRequestError, match="already in use"):
        q.add(twin)
    assert list(q.waiting) == [a]


def test_run_takes_a_request_from_anywhere_in_the_queue_by_identity() -> None:
    q = RequestQueues()
    a, b, c = req(4), req(4), req(4)
    for r in (a, b, c):
        q.add(r)
    q.run(b)
    assert list(q.waiting) == [a, c] and q.running == [b]
    assert b.status is RequestStatus.RUNNING


def test_requeue_goes_to_the_front_or_parks_until_the_first_token() -> None:
    q = RequestQueues()
    a, b, remote = req(4), req(4), req(4)
    remote.awaiting_first_token = True
    for r in (a, b, remote):
        q.add(r)
    for r in (b, remote):  # as if they had left the queue to load
        q.waiting.remove(r)
        r.status = RequestStatus.WAITING_FOR_KV
    q.requeue(b)
    q.requeue(remote)
    assert list(q.waiting) == [b, a] and b.status is RequestStatus.WAITING
    assert q.parked == {remote.request_id: remote}
    q.unpark(remote.request_id)
    assert list(q.waiting) == [remote, b, a] and not q.parked
    q.unpark(remote.request_id)  # no longer parked: nothing moves
    assert list(q.waiting) == [remote, b, a]


def test_remove_takes_a_request_out_of_wherever_it_is() -> None:
    q = RequestQueues()
    parked, running, waiting = req(4), req(4), req(4)
    parked.awaiting_first_token = True
    for r in (parked, running, waiting):
        q.add(r)
    q.park(parked)  # at the head of the queue, nothing to compute yet
    q.run(running)
    assert list(q.waiting) == [waiting] and q.running == [running] and parked.request_id in q.parked
    for r in (waiting, running, parked):
        assert q.remove(r.request_id) is r
    assert not q.waiting and not q.running and not q.parked and not q.requests
    assert q.remove(waiting.request_id) is None
    assert not q.has_unfinished()


def test_holders_count_every_request_with_slots_and_idle_ones_are_those_queued() -> None:
    q = RequestQueues()
    loaded, running, fresh = req(4), req(4), req(4)
    for r in (loaded, running, fresh):
        q.add(r)
    q.run(running)
    loaded.slots = [Slot(0)]
    running.slots = [Slot(1)]
    assert q.holders() == 2
    assert q.idle_holders() == [loaded]
