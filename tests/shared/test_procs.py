"""Port picking for a cluster's plan: ports chosen one after another before any service
binds them must not repeat or sit next to each other (a store listens on its port and the
next one); and the CPU time a process used, as the profiler reads it."""

from __future__ import annotations

import os
import subprocess
import time
from itertools import pairwise
from pathlib import Path

import pytest

from shared import procs
from shared.ports import listen_socket
from shared.procs import PortPicker, cpu_seconds, free_ports


def test_picks_are_distinct_and_never_adjacent() -> None:
    ports = free_ports(40)
    assert len(set(ports)) == 40
    spread = sorted(ports)
    assert all(b - a >= 2 for a, b in pairwise(spread))


def test_a_repeated_or_adjacent_pick_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may offer a port again until a service binds it; the picker skips it,
    and skips a port whose neighbour (its data plane) is taken."""
    first = free_ports(1)[0]
    fresh = free_ports(3)
    taken_above = next(p for p in fresh if p - 1 not in (first, first + 1))
    offers = iter([first, first, first + 1, taken_above, *fresh])  # a fake kernel
    monkeypatch.setattr(procs, "free_port", lambda: next(offers))
    picker = PortPicker()
    assert picker() == first
    with listen_socket("127.0.0.1", taken_above + 1):
        second = picker("decode", 0)
    assert second not in (first, first + 1, taken_above)
    assert second in fresh


def test_cpu_seconds_counts_what_a_process_used() -> None:
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) >= before + 0.1
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert cpu_seconds(dead.pid) == 0.0  # gone: nothing to read


def test_a_named_threads_cpu_can_be_left_out() -> None:
    """The profiler counts a worker's CPU beside its engine thread (named for the OS)."""
    import threading

    spun, read = threading.Event(), threading.Event()

    def spin() -> None:
        procs.name_thread("spinner-test")
        deadline = time.thread_time() + 0.3
        while time.thread_time() < deadline:
            pass
        spun.set()
        read.wait(10)  # alive (and listed) until the figures are read

    before_all = cpu_seconds(os.getpid())
    before_rest = cpu_seconds(os.getpid(), except_thread="spinner-test")
    t = threading.Thread(target=spin)
    t.start()
    assert spun.wait(10)
    names = [
        (task / "comm").read_text().strip() for task in Path(f"/proc/{os.getpid()}/task").iterdir()
    ]
    spent_all = cpu_seconds(os.getpid()) - before_all
    spent_rest = cpu_seconds(os.getpid(), except_thread="spinner-test") - before_rest
    read.set()
    t.join()
    assert "spinner-test" in names
    assert spent_all >= 0.25 and spent_rest < spent_all - 0.2
