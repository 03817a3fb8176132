"""Keeps a local cluster up: a child process that exits is restarted, with a backoff
that doubles while it keeps failing, and given up on (stopping the cluster) only
after too many restarts within a window. A Redis server that dies is restarted
on its port; the services re-register and republish what they hold (their
heartbeats notice their keys are gone).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

from shared.errors import BatonError
from shared.launcher import LocalCluster
from shared.procs import ServiceProcess


class SupervisorGaveUp(BatonError):
    """A child kept failing: more restarts than the policy allows in its window."""


@dataclass(frozen=True)
class RestartPolicy:
    first_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    max_restarts: int = 10  # within window_s, per child
    window_s: float = 300.0
    healthy_after_s: float = 60.0  # up this long: the next failure starts the backoff over


@dataclass
class _Child:
    restarts: deque[float] = field(default_factory=deque)
    backoff_s: float = 0.0
    died_at: float | None = None
    started_at: float = field(default_factory=time.monotonic)


def exit_reason(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    def __init__(
        self,
        cluster: LocalCluster,
        policy: RestartPolicy | None = None,
        say: Callable[[str], None] = print,
    ):
        self.cluster = cluster
        self.policy = policy or RestartPolicy()
        self.say = say
        self._children: dict[str, _Child] = {}
        self.restarts = 0

    def check(self) -> list[str]:
        """One pass: restart what is due; returns the names restarted. Raises
        :class:`SupervisorGaveUp` when a child exceeded the restart limit."""
        restarted = []
        redis = self.cluster.redis
        if redis.proc is not None and redis.proc.poll() is not None:
            self.say(f"baton: redis-server {exit_reason(redis.proc.returncode)}; restarting")
            try:
                redis.start()
                restarted.append("redis")
            except BatonError as exc:  # its port still held, say: the next pass tries again
                self.say(f"baton: redis-server did not start again: {exc}")
        now = time.monotonic()
        for name, proc in list(self.cluster.procs.items()):
            if self._due(name, proc, now):
                proc.start()
                self._children[name].started_at = now
                self.restarts += 1
                restarted.append(name)
        return restarted

    def _due(self, name: str, proc: ServiceProcess, now: float) -> bool:
        child = self._children.setdefault(name, _Child())
        if proc.alive:
            return False
        p = self.policy
        if child.died_at is None:  # just noticed
            child.died_at = now
            if now - child.started_at > p.healthy_after_s:
                child.backoff_s = 0.0
            child.backoff_s = min(
                p.max_backoff_s, child.backoff_s * 2 if child.backoff_s else p.first_backoff_s
            )
            while child.restarts and now - child.restarts[0] > p.window_s:
                child.restarts.popleft()
            if len(child.restarts) >= p.max_restarts:
                raise SupervisorGaveUp(
                    f"{name} failed {len(child.restarts) + 1} times in {p.window_s:.0f}s; "
                    f"giving up:\n{proc.log_tail(10)}"
                )
            code = proc.proc.returncode if proc.proc is not None else None
            self.say(
                f"baton: {name} {exit_reason(code)}; restarting in {child.backoff_s:.1f}s\n"
                f"{proc.log_tail(5)}"
            )
        if now - child.died_at < child.backoff_s:
            return False
        child.died_at = None
        child.restarts.append(now)
        return True

    def run(self, stop: threading.Event, interval_s: float = 0.2) -> None:
        """Check every ``interval_s`` until ``stop`` is set (raises if it gives up)."""
        while not stop.wait(interval_s):
            self.check()


class SupervisorThread:
    """Runs a :class:`Supervisor` in the background (tests, benchmarks).

    The children it restarts die with this thread (they are started with a parent-death
    signal, which Linux ties to the starting thread), so it lives until :meth:`stop`;
    :meth:`hold` and :meth:`release` suspend and resume the supervision meanwhile.
    """

    def __init__(self, supervisor: Supervisor, interval_s: float = 0.2):
        self.supervisor = supervisor
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self._held = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)

    def _run(self, interval_s: float) -> None:
        try:
            while not self.stop_event.wait(interval_s):
                with self._lock:
                    if not self._held:
                        self.supervisor.check()
        except BaseException as exc:
            self.error = exc

    def hold(self) -> None:
        """No restart from now on (a check in progress completes first)."""
        with self._lock:
            self._held = True

    def release(self) -> None:
        with self._lock:
            self._held = False

    def start(self) -> SupervisorThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self._thread.join(10)


def run_until_signalled(cluster: LocalCluster, policy: RestartPolicy | None = None) -> int:
    """``baton up``: start, print the URL, keep every child up until Ctrl-C / SIGTERM,
    then stop everything cleanly (in reverse order)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    t0 = time.perf_counter()
    cluster.start()  # Ctrl-C here interrupts start-up, which tears down what started
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(
        f"baton: cluster up in {time.perf_counter() - t0:.1f} s; "
        f"OpenAI API at {cluster.gateway_url}/v1 (redis {cluster.redis.url}); Ctrl-C stops",
        flush=True,
    )
    supervisor = Supervisor(cluster, policy, say=lambda m: print(m, file=sys.stderr, flush=True))
    try:
        supervisor.run(stop, interval_s=0.5)
        return 0
    except SupervisorGaveUp as exc:
        print(f"baton: {exc}; stopping", file=sys.stderr, flush=True)
        return 1
    finally:
        print("baton: stopping", flush=True)
        cluster.stop()
