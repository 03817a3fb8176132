"""A fake CPU source for the elastic-threads policy: scripted, no machine read."""

from __future__ import annotations

from shared.engine.cpu_load import CpuTimes


class FakeCpuSource:
    """Scripted: ``running`` threads of other processes run now, ``siblings`` of them
    engine threads of the roles beside this one; other processes keep ``others_load``
    cores busy on average (it accrues as time advances); ``now`` is the clock."""

    def __init__(self, cpus: int = 2):
        self.cpus = cpus
        self.now = 0.0
        self.running = 0
        self.siblings = 0
        self.others_load = 0.0
        self.machine = 0.0  # busy CPU-seconds of every process so far

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.machine += self.others_load * seconds

    def running_others(self) -> int:
        return self.running

    def busy_siblings(self) -> int:
        return self.siblings

    def cpu_times(self) -> CpuTimes:
        return CpuTimes(self.now, self.machine, 0.0)
