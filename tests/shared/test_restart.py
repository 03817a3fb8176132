"""Stopping and starting again on the same ports: ``baton up`` ten times in a row, each
listener kind binding over a connection in TIME_WAIT on its port; a port that another
process really holds is one line naming it and a non-zero exit; a failed start-up keeps its
traceback inside the JSON record (``exc``), never as the message."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from shared.errors import ConfigError, PeerLostError, PortInUseError
from shared.logs import JsonFormatter
from shared.ports import check_port_free, listen_socket
from shared.procs import RedisProcess, ServiceProcess, free_port, free_ports
from shared.transport.base import Connection
from shared.transport.tcp import TcpTransport

MODEL = "SmolLM2-135M-Instruct"
ROUNDS = 10
# more than one KV block (16 tokens): prefill writes to the store, so every round uses
# the data plane (which may leave connections in TIME_WAIT on the store's listener)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 5
TIME_WAIT = "06"  # /proc/net/tcp state


def time_wait_on(port: int) -> int:
    """Connections in TIME_WAIT whose *local* port is ``port`` (the side that blocks a bind)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == TIME_WAIT and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def leave_time_wait(port: int) -> None:
    """Leave a connection in TIME_WAIT whose local port is ``port``, as a stopped server that
    closed its side first does. Whether a real run leaves one depends on which end of each
    connection closes first (it varies by host and transport), so the test makes its own."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1)
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server's end closes first: its socket is the one left in TIME_WAIT
    client.recv(1)  # the server's FIN has arrived
    client.close()
    listener.close()
    deadline = time.monotonic() + 5
    while not time_wait_on(port):
        assert time.monotonic() < deadline, f"no connection in TIME_WAIT on port {port}"
        time.sleep(0.01)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "UCX_"))}
    return env | extra


class BatonUp:
    """``baton up`` as a subprocess, its output collected line by line."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "up", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.lines: list[str] = []
        self.up = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())
            if "cluster up" in self.lines[-1]:
                self.up.set()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._reader.join(10)


def test_baton_up_restarts_on_the_same_ports_ten_times(cache_dir: Path) -> None:
    """Every port fixed (gateway, prefill, decode, store HTTP and UCX data plane, Redis);
    each round starts right after the last one stopped and answers a request."""
    gateway, prefill, decode, kvstore, redis = free_ports(5)
    args = [
        "--port", str(gateway), "--prefill-port", str(prefill), "--decode-port", str(decode),
        "--kvstore-port", str(kvstore), "--redis-port", str(redis),
        "--kv-cache-gb", "0.0625", "--kvstore-gb", "0.0625",
    ]  # fmt: skip
    # cheap start-up: no pre-faulting of the (small) KV pools
    env = clean_env(BATON_CACHE_DIR=str(cache_dir), BATON_PREFAULT_KV="false")
    listening = [gateway, prefill, decode, kvstore, kvstore + 1, redis]
    left_by_runs = 0
    timings = []
    for round_ in range(ROUNDS):
        left_by_runs += any(time_wait_on(port) for port in listening)
        # every listener binds over a connection in TIME_WAIT on its own port (what failed
        # before the store's UCX listener set SO_REUSEADDR), whatever the last run left
        for port in listening:
            if not time_wait_on(port):
                leave_time_wait(port)
        t0 = time.monotonic()
        up = BatonUp(args, env)
        try:
            assert up.up.wait(120), f"round {round_} did not come up:\n{up.tail()}"
            r = httpx.post(
                f"http://127.0.0.1:{gateway}/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0},
                timeout=60,
            )
            assert r.status_code == 200, f"round {round_}: {r.text}\n{up.tail()}"
        finally:
            code = up.stop()
        assert code == 0, f"round {round_} stopped with {code}:\n{up.tail()}"
        assert not any("Traceback" in line for line in up.lines), up.tail(200)
        timings.append(time.monotonic() - t0)
    rounds = [round(t, 1) for t in timings]
    print(f"rounds (s): {rounds}; {left_by_runs} found TIME_WAIT left by the last run")


def test_a_taken_port_fails_baton_up_in_one_line(cache_dir: Path) -> None:
    roles = ("gateway", "prefill", "decode", "kvstore", "redis")
    ports = dict(zip(roles, free_ports(len(roles)), strict=True))
    args = [
        "--port", str(ports["gateway"]), "--prefill-port", str(ports["prefill"]),
        "--decode-port", str(ports["decode"]), "--kvstore-port", str(ports["kvstore"]),
    ]  # fmt: skip
    env = clean_env(BATON_CACHE_DIR=str(cache_dir))
    cases = [
        (ports["kvstore"] + 1, [], f"kvstore-0: port {ports['kvstore'] + 1} (data plane)"),
        (ports["gateway"], [], f"gateway: port {ports['gateway']} (HTTP)"),
        (ports["redis"], ["--redis-port", str(ports["redis"])], f"port {ports['redis']} (redis)"),
    ]
    for port, more, names in cases:
        with listen_socket("127.0.0.1", port):  # another process's listener, in effect
            proc = subprocess.run(
                [sys.executable, "-m", "shared.cli", "up", *args, *more],
                capture_output=True, text=True, env=env, timeout=120,
            )  # fmt: skip
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr == f"baton: error: {names} is already in use\n", proc.stderr
        assert "Traceback" not in proc.stdout


def test_ports_planned_twice_are_refused() -> None:
    from shared.launcher import Topology, check_ports, plan

    port = free_port()
    specs = plan(Topology(redis_url="redis://r:1/0", ports=lambda role, i: port))
    with pytest.raises(ConfigError) as twice:
        check_ports(specs)
    assert str(twice.value) == (
        f"port {port} is planned twice: kvstore-0 (HTTP) and kvstore-0 (data plane)"
    )


@pytest.mark.parametrize(
    ("transport", "taken"), [("tcp", "data"), ("ucx", "data"), ("tcp", "http")]
)
def test_a_service_whose_port_is_taken_says_so_in_one_line(
    tmp_path: Path, transport: str, taken: str
) -> None:
    """The race the launcher's check cannot close (a port taken after it looked): the
    service exits 2 with one line the launcher passes on, and no traceback."""
    http, data = free_ports(2)
    env = {
        "BATON_REDIS_URL": "redis://127.0.0.1:9/0",  # never reached: the bind fails first
        "BATON_TRANSPORT": transport,
        "BATON_KVSTORE_HTTP_PORT": str(http),
        "BATON_KVSTORE_DATA_PORT": str(data),
        "BATON_KVSTORE_CAPACITY_GB": "0.0625",
    }
    port, what = (data, "data plane") if taken == "data" else (http, "HTTP")
    log = tmp_path / "kvstore.log"
    with listen_socket("0.0.0.0", port):
        proc = ServiceProcess(
            "services.kvstore", env, f"http://127.0.0.1:{http}/ready", log, name="kvstore-0"
        ).start()
        try:
            with pytest.raises(ConfigError) as failed:
                proc.wait_ready(60)
        finally:
            proc.stop()
    assert str(failed.value) == f"kvstore-0: port {port} ({what}) is already in use"
    assert proc.proc is not None and proc.proc.returncode == 2
    out = log.read_text()
    assert "Traceback" not in out
    assert f"baton kvstore: error: port {port} ({what}) is already in use" in out.splitlines()


# --- each listener kind binds again over its own connections in TIME_WAIT ------------


def test_service_http_socket_binds_over_time_wait() -> None:
    port = free_port()
    listener = listen_socket("127.0.0.1", port, "HTTP")
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server closes first (uvicorn ending keep-alive connections)
    assert client.recv(1) == b""
    client.close()
    listener.close()
    deadline = time.monotonic() + 5
    while not time_wait_on(port) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert time_wait_on(port)
    plain = socket.socket()
    with pytest.raises(OSError):  # the failure this is about: a bind without SO_REUSEADDR
        plain.bind(("127.0.0.1", port))
    plain.close()
    listen_socket("127.0.0.1", port, "HTTP").close()
    check_port_free("0.0.0.0", port)


async def test_tcp_data_plane_binds_over_time_wait() -> None:
    transport = TcpTransport()
    port = free_port()

    async def hang_up(conn: Connection) -> None:
        return  # the listener closes the connection: the server side closes first

    listener = await transport.listen("127.0.0.1", port, hang_up)
    conn = await transport.connect("127.0.0.1", port)
    with pytest.raises(PeerLostError):
        await conn.recv()
    await conn.close()
    await listener.close()
    for _ in range(100):
        if time_wait_on(port):
            break
        await asyncio.sleep(0.01)
    assert time_wait_on(port)
    again = await transport.listen("127.0.0.1", port, hang_up)
    await again.close()


def test_redis_restarts_on_its_port_over_time_wait() -> None:
    server = RedisProcess(free_port()).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(b"PING\r\n")
            assert client.recv(16).startswith(b"+PONG")
            assert server.proc is not None
            server.proc.kill()  # the kernel closes the server's side first
            server.proc.wait(10)
            assert client.recv(1) == b""
        deadline = time.monotonic() + 5
        while not time_wait_on(server.port) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert time_wait_on(server.port)
        server.start()
    finally:
        server.stop()


def test_a_port_held_by_a_listener_is_port_in_use() -> None:
    port = free_port()
    with listen_socket("127.0.0.1", port), pytest.raises(PortInUseError, match=f"port {port} "):
        check_port_free("0.0.0.0", port, "HTTP")  # every interface overlaps 127.0.0.1


# --- tracebacks stay inside the JSON record -------------------------------------------

FAILING_SERVICE = """
import sys
from shared.errors import ConfigError
from shared.service import run_service, service_app

class Failing:
    async def start(self):
        raise {error}("the component could not start")

    async def stop(self):
        pass

async def build():
    return Failing()

run_service("demo", lambda: (service_app("demo", build), "127.0.0.1", {port}))
"""


def run_failing_service(error: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(FAILING_SERVICE).format(error=error, port=free_port())
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env()
    )


def test_an_unexpected_startup_failure_is_one_json_record_with_its_traceback() -> None:
    proc = run_failing_service("RuntimeError")
    assert proc.returncode == 1
    *lines, last = proc.stderr.splitlines()
    assert last == "baton demo: error: start-up failed: RuntimeError: the component could not start"
    records = [json.loads(line) for line in lines]  # all JSON
    (failed,) = [r for r in records if "exc" in r]
    assert failed["msg"] == "RuntimeError: the component could not start"
    assert failed["exc"].startswith("Traceback (most recent call last):")
    assert "in start\nRuntimeError: the component could not start" in failed["exc"]


def test_an_expected_startup_failure_is_one_line() -> None:
    proc = run_failing_service("ConfigError")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == "baton demo: error: the component could not start"


def test_json_formatter_moves_tracebacks_out_of_the_message() -> None:
    import logging

    fmt = JsonFormatter("svc")
    text = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad'

    def record(msg: str, exc_info: object = None) -> dict[str, object]:
        rec = logging.LogRecord("l", logging.ERROR, "f", 1, msg, None, exc_info)  # type: ignore[arg-type]
        line = fmt.format(rec)
        assert "\n" not in line
        return dict(json.loads(line))

    assert record(text) | {"ts": 0, "time": 0} == {
        "ts": 0, "time": 0, "level": "error", "service": "svc", "logger": "l",
        "msg": "ValueError: bad", "exc": text,
    }  # fmt: skip
    assert record(f"it failed:\n{text}")["msg"] == "it failed:"
    try:
        raise KeyError("k")
    except KeyError:
        caught = record("lost", sys.exc_info())
    assert caught["msg"] == "lost" and "KeyError: 'k'" in str(caught["exc"])
    assert "exc" not in record("fine")
