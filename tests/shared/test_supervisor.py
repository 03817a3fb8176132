"""The supervisor's restart policy, on fake child processes (pure logic, no services):
backoff doubles while a child keeps failing, starts over once it stayed up, and the
supervisor gives up past the restart limit; a dead Redis is restarted."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from shared.errors import ConfigError
from shared.supervisor import RestartPolicy, Supervisor, SupervisorGaveUp


@dataclass
class FakePopen:
    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@dataclass
class FakeProc:
    """Stands in for a ServiceProcess: alive until ``die``; ``start`` revives it."""

    proc: FakePopen = field(default_factory=FakePopen)
    starts: int = 0

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def die(self, code: int = -9) -> None:
        self.proc.returncode = code

    def start(self) -> FakeProc:
        self.starts += 1
        self.proc = FakePopen()
        return self

    def log_tail(self, n: int) -> str:
        return "last words"


@dataclass
class FakeCluster:
    procs: dict[str, FakeProc]
    redis: FakeProc = field(default_factory=FakeProc)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr("shared.supervisor.time.monotonic", lambda: now[0])
    return now


def make(cluster: FakeCluster, said: list[str], **policy: float) -> Supervisor:
    return Supervisor(cluster, RestartPolicy(**policy), say=said.append)  # type: ignore[arg-type]


def test_backoff_doubles_while_failing_and_resets_after_a_healthy_run(clock: list[float]) -> None:
    child = FakeProc()
    said: list[str] = []
    sup = make(FakeCluster({"decode-0": child}), said, first_backoff_s=1.0, healthy_after_s=60)
    waits = []
    for _ in range(3):
        child.die()
        assert sup.check() == []
        died = clock[0]
        while not sup.check():
            clock[0] += 0.25
        waits.append(clock[0] - died)
        clock[0] += 1.0  # dies again soon
    assert waits == [1.0, 2.0, 4.0]
    assert "decode-0 killed by SIGKILL; restarting in 1.0s" in said[0]
    clock[0] += 120  # a healthy run
    child.die(code=1)
    assert sup.check() == []
    assert "exited with code 1; restarting in 1.0s" in said[-1]


def test_gives_up_past_the_restart_limit(clock: list[float]) -> None:
    child = FakeProc()
    sup = make(FakeCluster({"prefill-0": child}), [], first_backoff_s=0.1, max_restarts=3)
    for _ in range(3):
        child.die()
        sup.check()
        clock[0] += 1.0
        assert sup.check() == ["prefill-0"]
    child.die()
    with pytest.raises(SupervisorGaveUp, match="prefill-0 failed 4 times"):
        sup.check()


def test_old_restarts_leave_the_window(clock: list[float]) -> None:
    child = FakeProc()
    sup = make(FakeCluster({"kvstore-0": child}), [], first_backoff_s=0.1, max_restarts=2,
               window_s=100, healthy_after_s=1e9)  # fmt: skip
    for _ in range(5):
        child.die()
        sup.check()
        clock[0] += 200.0  # outside the window each time
        assert sup.check() == ["kvstore-0"]
    assert child.starts == 5


def test_a_dead_redis_is_restarted_at_once(clock: list[float]) -> None:
    cluster = FakeCluster({})
    said: list[str] = []
    sup = make(cluster, said)
    cluster.redis.die(code=-15)
    assert sup.check() == ["redis"]
    assert cluster.redis.starts == 1
    assert "redis-server killed by SIGTERM; restarting" in said[0]


def test_a_redis_that_does_not_start_again_is_retried(clock: list[float]) -> None:
    class StubbornRedis(FakeProc):
        fails = 1

        def start(self) -> FakeProc:
            if self.fails:
                self.fails -= 1
                raise ConfigError("redis-server did not answer")
            return super().start()

    cluster = FakeCluster({}, StubbornRedis())
    said: list[str] = []
    sup = make(cluster, said)
    cluster.redis.die()
    assert sup.check() == []
    assert "did not start again" in said[-1]
    assert sup.check() == ["redis"]
