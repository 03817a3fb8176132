"""What one HTTP hop into a Baton service costs after the service sat idle, against the
same hop back to back.

A lone user's request crosses several processes on its way to the first token
(client -> gateway -> prefill -> the KV store, and the token back), each idle
since the previous request. This starts the cluster ``baton up`` starts and, for
each of its services and for a bare blocking echo server (the machine's floor: a
process woken by a socket, no event loop), sends ``GET /health`` on a kept-alive
connection after idle gaps of 0, 10, 50 and 200 ms, reads the whole response and
prints the median round trip per gap. Where idle cores lose their caches (other
tenants of the host), the 200 ms column is several times the 0 ms one, and a
served prompt pays it once per hop.

    python -m benchmarks.idle_hop --repeats 15
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_cluster import bench_cluster
from benchmarks.results import save_json
from shared.hardware import cpu_model
from shared.procs import free_port

GAPS_MS = (0, 10, 50, 200)
ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
while True:
    c, _ = s.accept()
    while c.recv(65536):
        c.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\n{}")
"""


def _response(sock: socket.socket) -> None:
    """Read one whole HTTP response (a Content-Length body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)


def round_trips(port: int, gap_s: float, repeats: int) -> list[float]:
    """``repeats`` GET /health round trips (seconds), each after ``gap_s`` of idle."""
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    out = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(request)
        _response(sock)
        for _ in range(repeats):
            time.sleep(gap_s)
            t0 = time.perf_counter()
            sock.sendall(request)
            _response(sock)
            out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    echo_port = free_port()
    echo = subprocess.Popen([sys.executable, "-c", ECHO, str(echo_port)])
    try:
        with bench_cluster(None, "idle-hop", {}, dtype="bfloat16") as local:
            targets = [("echo (floor)", echo_port)]
            targets += [(s.name, s.http_port) for s in local.specs]
            print(f"host: {cpu_model()}; median GET /health round trip after an idle gap")
            print(f"{'':14s}" + "".join(f"{g:>9d} ms" for g in GAPS_MS))
            for name, port in targets:
                medians = [
                    statistics.median(round_trips(port, g / 1000, args.repeats)) for g in GAPS_MS
                ]
                rows.append({"target": name, "gaps_ms": GAPS_MS, "median_s": medians})
                print(f"{name:14s}" + "".join(f"{m * 1e3:9.2f} ms" for m in medians), flush=True)
    finally:
        echo.terminate()
        echo.wait()
    save_json(args.out, {"cpu": cpu_model(), "rows": rows})


if __name__ == "__main__":
    main()
