"""A fake CPU source for the elastic-threads policy: scripted, no machine read."""

from __future__ import annotations

from shared.engine.elastic_threads import CpuSample


class FakeCpuSource:
    """Scripted samples: ``busy`` is what other processes use (cores) from each tick on."""

    def __init__(self, cpus: int = 2):
        self.cpus = cpus
        self.now = 0.0
        self.busy_s = 0.0
        self.own_s = 0.0
        self.others = 0.0  # cores others keep busy
        self.own = 1.0  # cores this process keeps busy
        self.running = 0  # threads of others running right now

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.busy_s += (self.others + self.own) * seconds
        self.own_s += self.own * seconds

    def sample(self) -> CpuSample:
        return CpuSample(self.now, self.busy_s, self.own_s)

    def running_others(self) -> int:
        return self.running
