"""``benchmarks/idle_hop.py``'s client against its own echo server (no cluster)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from benchmarks.idle_hop import ECHO, round_trips
from shared.procs import free_port


def test_round_trips_read_whole_responses_after_each_gap() -> None:
    port = free_port()
    echo = subprocess.Popen([sys.executable, "-c", ECHO, str(port)])
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        times = round_trips(port, 0.01, 3)
    finally:
        echo.terminate()
        echo.wait()
    assert len(times) == 3 and all(0 < t < 5 for t in times)
