"""A fake CPU source for the elastic-threads policy: scripted, no machine read."""

from __future__ import annotations


class FakeCpuSource:
    """Scripted: ``running`` threads of other processes run now, ``siblings`` of them
    engine threads of the roles beside this one; ``now`` is the clock."""

    def __init__(self, cpus: int = 2):
        self.cpus = cpus
        self.now = 0.0
        self.running = 0
        self.siblings = 0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def running_others(self) -> int:
        return self.running

    def busy_siblings(self) -> int:
        return self.siblings
