"""A discrete-event simulation of a disaggregated deployment serving a workload.

DistServe chooses its split and batch limits by simulating the workload against
measured step times; this is that simulation for Baton, fed by a
:class:`~shared.capacity.profile.Profile` taken on the machine at hand.

What is modelled, per instance:

- **Prefill** instances (the router sends each request to the one with the
  fewest queued tokens) compute one prompt per step, the one with the fewest
  tokens left, as the prefill role's scheduler does (``shortest_prompt_first``),
  in chunks of at most ``max_batched_tokens``. A step lasts its chunk's cost (a
  chunk of tokens ``[a, b)`` of a prompt costs the profile's prefill time for
  ``b`` tokens less that for ``a``), plus the time to load the
  prompt blocks the KV store already holds (prefix-hash workloads: the blocks
  of a prompt's leading ids prefilled before, by any instance, are loaded, not
  computed; the last prompt token is always computed). A
  prompt's first token comes at the end of its last step.
- **Handoff**: the decode instance loads the prompt's KV at the profile's
  transfer speed (layer-wise streaming hides most of it; the whole load is
  counted, which errs towards later first decode steps).
- **Decode** instances (each request goes to the one with the fewest streams
  routed to it, those whose KV is still loading included, as the gateway counts
  its own picks) run continuous
  batches of at most ``max_seqs`` requests; a step lasts the profile's decode
  time for its batch size and summed context, and gives every request in it
  one token. With a TPOT target (``pace_s``), a step starts no sooner than
  ``pace_s`` after the last one began while a prefill instance computes, as
  the paced engine does: the decode thread waits off the cores meanwhile and
  requests arriving then join the next step.
- **Serving overhead**: what the profile measured serving adds beyond the
  engine (:mod:`shared.capacity.overhead`): per prompt, a wait between its
  last prefill step and its first token (the hops through the gateway and the
  store; their CPU is the side processes'), and per decode step, by its batch
  size, CPU of the engine's thread (the loop around the step).
- **Processes beside the engines**: the gateway, the KV store and Redis, the
  workers' threads beside their engine's (moving KV, streaming tokens) and,
  with ``client_on_host``, the load generator burn CPU per request, per
  prompt token (its KV goes through the store) and per streamed token, as the
  profile measured; each is one thread on the shared cores that works off what
  it is handed, slowing the engines while it runs.
- **Cores**: instances share the ``cores`` given as a processor-sharing
  system: while more threads compute than there are cores, every running step
  progresses at cores / threads of its full speed (time slicing), and speeds
  up again as others finish.

Requests are counted from their arrival; TTFT ends at the first token, TPOT is
(last token - first token) / (output tokens - 1). Goodput is the requests
meeting both SLOs per second of the run (first arrival to last token), as
``baton bench`` counts it.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.capacity.profile import Profile, SideCpu
from shared.capacity.sim_types import (
    Deployment,
    InstanceStats,
    RequestOutcome,
    SideStats,
    SimRequest,
    SimResult,
)


@dataclass
class _Req:
    spec: SimRequest
    index: int
    to_compute: int  # prompt tokens left to compute
    load_bytes: int  # prompt KV loaded from the store instead of computed
    first_token_s: float = 0.0
    generated: int = 0  # tokens so far (the first comes from prefill)
    decode: _Instance | None = None  # where it streams from


@dataclass
class _Instance:
    role: str
    threads: int
    queue: deque[_Req] = field(default_factory=deque)
    running: list[_Req] = field(default_factory=list)
    busy: bool = False
    queued_tokens: int = 0
    assigned: int = 0  # decode: requests routed here and not finished (loading included)
    steps: int = 0
    work_s: float = 0.0
    busy_s: float = 0.0
    step_began: float = 0.0
    paced_until: float = 0.0  # decode: no step before this (pacing)

    def begin_step(self, now: float, work_s: float) -> None:
        self.busy = True
        self.step_began = now
        self.steps += 1
        self.work_s += work_s

    def end_step(self, now: float) -> None:
        self.busy = False
        self.busy_s += now - self.step_began

    def stats(self) -> InstanceStats:
        return InstanceStats(self.role, self.steps, self.work_s, self.busy_s)


class _Clock:
    """Events in time order; ties keep the order they were scheduled in."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run(self) -> None:
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()


@dataclass
class _Job:
    threads: int
    remaining_s: float  # of work at full speed
    done: Callable[[], None]


class _Cpu:
    """Processor sharing: running jobs progress at min(1, cores / threads running)."""

    def __init__(self, cores: int, clock: _Clock):
        self.cores = cores
        self.clock = clock
        self.jobs: list[_Job] = []
        self._last = 0.0
        self._version = 0

    def start(self, threads: int, work_s: float, done: Callable[[], None]) -> None:
        self._advance()
        self.jobs.append(_Job(threads, work_s, done))
        self._reschedule()

    def _rate(self) -> float:
        threads = sum(j.threads for j in self.jobs)
        return min(1.0, self.cores / threads) if threads else 1.0

    def _advance(self) -> None:
        progress = (self.clock.now - self._last) * self._rate()
        for job in self.jobs:
            job.remaining_s -= progress
        self._last = self.clock.now

    def _reschedule(self) -> None:
        self._version += 1
        if not self.jobs:
            return
        first = min(j.remaining_s for j in self.jobs)
        version = self._version
        self.clock.at(self.clock.now + max(0.0, first) / self._rate(), lambda: self._end(version))

    def _end(self, version: int) -> None:
        if version != self._version:
            return  # the running set changed since this was scheduled
        self._advance()
        done = [j for j in self.jobs if j.remaining_s <= 1e-12]
        self.jobs = [j for j in self.jobs if j.remaining_s > 1e-12]
        self._reschedule()
        for job in done:
            job.done()


class _Side:
    """A process beside the engines (the gateway and the KV store, or a load generator):
    one thread working off the CPU that serving hands it, on the shared cores."""

    def __init__(self, name: str, cpu: _Cpu, cost: SideCpu):
        self.name = name
        self.cpu = cpu
        self.cost = cost
        self.backlog_s = 0.0
        self.charged_s = 0.0
        self.busy = False

    def charge(self, requests: int, prompt_tokens: int, output_tokens: int) -> None:
        work = self.cost.seconds(requests, prompt_tokens, output_tokens)
        self.backlog_s += work
        self.charged_s += work
        self._run()

    def _run(self) -> None:
        if self.busy or self.backlog_s <= 0:
            return
        work, self.backlog_s = self.backlog_s, 0.0
        self.busy = True
        self.cpu.start(1, work, self._done)

    def _done(self) -> None:
        self.busy = False
        self._run()


def simulate(
    requests: Sequence[SimRequest],
    deployment: Deployment,
    profile: Profile,
    cores: int,
    *,
    client_on_host: bool = False,
) -> SimResult:
    """``client_on_host``: the load generator shares the cores (as in a benchmark on
    the serving machine), so its CPU is charged too."""
    if deployment.prefill < 1 or deployment.decode < 1 or cores < 1:
        raise ValueError("a deployment needs a prefill and a decode instance and a core")
    clock = _Clock()
    t = deployment.threads
    prefills = [_Instance("prefill", t) for _ in range(deployment.prefill)]
    decodes = [_Instance("decode", t) for _ in range(deployment.decode)]
    cpu = _Cpu(cores, clock)
    sides = [
        _Side("cluster", cpu, profile.overhead.cluster),
        _Side("workers", cpu, profile.overhead.workers),
    ]
    if client_on_host:
        sides.append(_Side("client", cpu, profile.overhead.client))
    stored: set[int] = set()
    outcomes: dict[int, RequestOutcome] = {}

    def arrive(i: int, spec: SimRequest) -> None:
        cached = 0
        for block in spec.block_ids:
            if block not in stored:
                break
            cached += spec.block_tokens
        cached = min(cached, spec.input_len - 1)
        req = _Req(spec, i, spec.input_len - cached, profile.load_bytes(cached))
        inst = min(prefills, key=lambda p: p.queued_tokens)
        inst.queue.append(req)
        inst.queued_tokens += req.to_compute
        start_prefill(inst)

    def start_prefill(inst: _Instance) -> None:
        if inst.busy or not inst.queue:
            return
        # one prompt, the fewest tokens left first (the earliest among equals)
        req = min(inst.queue, key=lambda r: r.to_compute)
        take = min(req.to_compute, deployment.max_batched_tokens)
        batch = [(req, take)]
        # a chunk costs what its tokens add along its own prompt's curve (attention to
        # the tokens before it included)
        start = req.spec.input_len - req.to_compute
        compute_s = profile.prefill_seconds(start + take, inst.threads)
        compute_s -= profile.prefill_seconds(start, inst.threads)
        load, req.load_bytes = req.load_bytes, 0
        seconds = compute_s + load / profile.transfer_bytes_s
        inst.begin_step(clock.now, seconds)
        cpu.start(inst.threads, seconds, lambda: end_prefill(inst, batch))

    def end_prefill(inst: _Instance, batch: list[tuple[_Req, int]]) -> None:
        inst.end_step(clock.now)
        for req, took in batch:
            req.to_compute -= took
            inst.queued_tokens -= took
            if req.to_compute == 0:
                inst.queue.remove(req)
                stored.update(req.spec.block_ids)
                # the hops to the first token: a wait, not CPU (what serving spends on
                # the way, the sides charge)
                clock.at(
                    clock.now + profile.overhead.request_s, functools.partial(first_token, req)
                )
        start_prefill(inst)

    def first_token(req: _Req) -> None:
        req.first_token_s = clock.now
        req.generated = 1
        handoff(req)

    def charge(requests: int, prompt_tokens: int, output_tokens: int) -> None:
        for side in sides:
            side.charge(requests, prompt_tokens, output_tokens)

    def handoff(req: _Req) -> None:
        charge(1, req.spec.input_len, 1)
        if req.generated >= req.spec.output_len:
            finish(req)
            return
        # the least loaded, counting the streams routed there whose KV is still on its
        # way (as the gateway counts its own picks): prompts that end in one prefill step
        # are spread, not all sent to the instance that looked emptiest before them
        dec = min(decodes, key=lambda d: d.assigned)
        dec.assigned += 1
        req.decode = dec
        load_s = profile.load_bytes(req.spec.input_len) / profile.transfer_bytes_s

        def join() -> None:
            dec.queue.append(req)
            start_decode(dec)

        clock.at(clock.now + load_s, join)

    def start_decode(dec: _Instance) -> None:
        if dec.busy or clock.now < dec.paced_until:
            return
        while dec.queue and len(dec.running) < deployment.max_seqs:
            dec.running.append(dec.queue.popleft())
        if not dec.running:
            return
        context = sum(r.spec.input_len + r.generated for r in dec.running)
        seconds = profile.decode_seconds(len(dec.running), context, dec.threads)
        seconds += profile.overhead.decode_step_s(len(dec.running))
        dec.begin_step(clock.now, seconds)
        cpu.start(dec.threads, seconds, lambda: end_decode(dec))

    def end_decode(dec: _Instance) -> None:
        dec.end_step(clock.now)
        charge(0, 0, len(dec.running))
        still = []
        for req in dec.running:
            req.generated += 1
            if req.generated >= req.spec.output_len:
                finish(req)
            else:
                still.append(req)
        dec.running = still
        due = dec.step_began + deployment.pace_s
        if still and clock.now < due and any(p.busy for p in prefills):
            dec.paced_until = due
            clock.at(due, lambda: start_decode(dec))
            return
        start_decode(dec)

    def finish(req: _Req) -> None:
        if req.decode is not None:
            req.decode.assigned -= 1
        spec = req.spec
        tpot = (clock.now - req.first_token_s) / (spec.output_len - 1) if spec.output_len > 1 else 0
        outcomes[req.index] = RequestOutcome(req.first_token_s - spec.arrival_s, tpot, clock.now)

    for i, spec in enumerate(requests):
        clock.at(spec.arrival_s, lambda i=i, spec=spec: arrive(i, spec))  # type: ignore[misc]
    clock.run()
    ordered = tuple(outcomes[i] for i in range(len(requests)))
    start = min((r.arrival_s for r in requests), default=0.0)
    end = max((o.finished_s for o in ordered), default=start)
    instances = tuple(inst.stats() for inst in [*prefills, *decodes])
    charged = tuple(SideStats(side.name, side.charged_s) for side in sides)
    return SimResult(deployment, ordered, end - start, instances, charged)
