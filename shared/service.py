"""Running a service process: settings errors are one line, the app runs under uvicorn,
and its long-lived part is built, started and stopped by the app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Protocol, TypeVar

import anyio
import uvicorn
from fastapi import FastAPI, Request
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from shared.errors import BatonError
from shared.logs import configure_logging
from shared.ports import listen_socket


class Component(Protocol):
    """A service's long-lived part (clients, engine, listeners)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


GRACEFUL_SHUTDOWN_S = 5
DRAIN_LIMIT_S = 120.0  # past every drain timeout: a stuck drain never keeps a process up


KEEP_ALIVE_S = 75


class _DrainingServer(uvicorn.Server):
    """On SIGTERM the component drains first (new requests refused, running ones
    finished or handed over), then the server shuts down as usual; a second signal,
    or SIGINT, skips the drain."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.app = app
        self._drain_requested = False
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        component = getattr(self.app.state, "component", None)
        drain = getattr(component, "drain", None)
        if sig != signal.SIGTERM or self._drain_requested or drain is None:
            super().handle_exit(sig, frame)
            return
        self._drain_requested = True

        async def drain_then_exit(run: Callable[[], Awaitable[None]]) -> None:
            try:
                await asyncio.wait_for(run(), DRAIN_LIMIT_S)
            except TimeoutError:
                print("drain did not end in time; exiting", file=sys.stderr, flush=True)
            finally:
                super(_DrainingServer, self).handle_exit(sig, frame)

        def start() -> None:
            self._drain_task = asyncio.get_running_loop().create_task(drain_then_exit(drain))

        # a signal handler may run while the loop sleeps in select(): wake it up
        asyncio.get_running_loop().call_soon_threadsafe(start)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:  # uvicorn announces only the sockets it bound itself
            host, port = sockets[0].getsockname()[:2]
            logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d", host, port)


C = TypeVar("C", bound=Component)


def service_app(title: str, build: Callable[[], Awaitable[Component]]) -> FastAPI:
    """A FastAPI app whose lifespan builds and starts the component (created once, then
    injected into handlers through :func:`component_of`) and stops it on shutdown;
    ``/health`` answers as soon as the process serves HTTP."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            component = await build()
            await component.start()
        except Exception as exc:  # run_service reports it once the server gives up
            app.state.startup_error = exc
            raise
        app.state.component = component
        # anyio imports its asyncio backend at its first use, a streamed response's
        # first task group: in a request, with the GIL the engine thread waits for
        await anyio.sleep(0)
        freeze_startup_objects()
        try:
            yield
        finally:
            await component.stop()

    app = FastAPI(title=title, lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def freeze_startup_objects() -> None:
    """Move every object alive once the component has started (modules, the model's
    tensors, clients: ~200,000 in an engine process) out of the garbage collector's
    reach. A full collection walked them all, ~105 ms holding the GIL, which the engine
    thread needs between kernels: one during a service's first request held its
    prefill to a crawl (what the request itself allocates stays collectable)."""
    gc.collect()
    gc.freeze()


def component_of(request: Request, kind: type[C]) -> C:
    component = request.app.state.component
    if not isinstance(component, kind):
        raise TypeError(f"this app serves a {type(component).__name__}, not a {kind.__name__}")
    return component


def _settings_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "settings"
    return f"{where}: {first['msg']}"


class _ReportedStartupFailure(logging.Filter):
    """Starlette hands uvicorn a failed start-up as a formatted traceback, which uvicorn
    logs as the message. A failure Baton expects (a :class:`BatonError`: a port in use,
    Redis unreachable, ...) is reported by :func:`run_service` as one line instead, so
    its traceback record is dropped; any other keeps it (in the JSON record's ``exc``)."""

    def __init__(self, app: FastAPI):
        super().__init__()
        self.app = app

    def filter(self, record: logging.LogRecord) -> bool:
        expected = isinstance(getattr(self.app.state, "startup_error", None), BatonError)
        return not (expected and str(record.msg).startswith("Traceback (most recent call"))


# read by run_service itself (every other variable by a settings class): name -> default
PROCESS_ENV = {
    "BATON_LOG_LEVEL": "info",
    "BATON_LOG_FORMAT": "json",  # or text
    "BATON_CPUS": "",  # a CPU list pins the whole process, e.g. 0,1 (empty: no pinning)
}


def settings_help(module: str, settings: Sequence[type[BaseSettings]]) -> str:
    """``python -m services.<role> --help``: every variable the service reads, with its
    default (from the settings classes themselves)."""
    rows: list[tuple[str, str]] = []
    for cls in settings:
        prefix = str(cls.model_config.get("env_prefix", ""))
        for field_name, field in cls.model_fields.items():
            if field.default_factory is not None:  # a path is shown; an id, an address vary
                made = field.get_default(call_default_factory=True)
                default = str(made) if isinstance(made, Path) else "computed at start"
            elif field.default in (None, "", ()):
                default = "unset"
            else:
                default = str(field.default)
            rows.append((f"{prefix}{field_name}".upper(), default))
    rows += [(var, default or "unset") for var, default in PROCESS_ENV.items()]
    width = max(len(var) for var, _ in rows)
    return "\n".join(
        [
            f"usage: python -m {module}",
            "",
            "Takes no arguments: every setting is an environment variable.",
            "",
            *(f"  {var:<{width}}  (default: {default})" for var, default in rows),
        ]
    )


def _arguments(name: str, settings: Sequence[type[BaseSettings]]) -> None:
    args = sys.argv[1:]
    if not args:
        return
    if args[0] in ("-h", "--help"):
        print(settings_help(f"services.{name}", settings))
        sys.exit(0)
    print(
        f"baton {name}: error: takes no arguments, got {' '.join(args)!r} "
        "(settings are BATON_* variables: see --help)",
        file=sys.stderr,
    )
    sys.exit(2)


def run_service(
    name: str,
    build: Callable[[], tuple[FastAPI, str, int]],
    settings: Sequence[type[BaseSettings]] = (),
) -> None:
    """Build the app from the environment (``settings``: the classes it reads, for
    ``--help``) and serve it until SIGINT/SIGTERM."""
    _arguments(name, settings)
    # a crash in native code (kernels, UCX) prints every thread's Python stack to
    # stderr, which is the service's log, instead of ending the log mid-line
    faulthandler.enable()
    env = {var: os.environ.get(var, default) for var, default in PROCESS_ENV.items()}
    level = env["BATON_LOG_LEVEL"].upper()
    configure_logging(name, level=level, fmt=env["BATON_LOG_FORMAT"])
    cpus = env["BATON_CPUS"]
    if cpus:  # pin this process (benchmarks compare deployments on the same cores)
        try:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",") if c.strip()})
        except (ValueError, OSError) as exc:
            print(f"baton {name}: error: BATON_CPUS={cpus!r}: {exc}", file=sys.stderr)
            sys.exit(2)
    try:
        app, host, port = build()
    except ValidationError as exc:
        print(f"baton {name}: error: invalid setting {_settings_error(exc)}", file=sys.stderr)
        sys.exit(2)
    except BatonError as exc:
        print(f"baton {name}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        # held from here on, before the (slow) start-up: a second instance fails at once;
        # SO_REUSEADDR, so a restart right after a stop binds over connections in TIME_WAIT
        sock = listen_socket(host, port, "HTTP")
    except BatonError as exc:
        print(f"baton {name}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=level.lower(),
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,  # after a drain: streams left are cut
        # longer than any client keeps an idle connection (httpx: 5 s), so a client never
        # reuses a connection the server is closing at that moment
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    logging.getLogger("uvicorn.error").addFilter(_ReportedStartupFailure(app))
    server = _DrainingServer(config, app)
    try:
        server.run(sockets=[sock])
    except SystemExit:
        if server.started:
            raise
        error = getattr(app.state, "startup_error", None)
        if isinstance(error, BatonError):
            print(f"baton {name}: error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
        if error is not None:  # unexpected: its traceback is in the log record before
            what = f"{type(error).__name__}: {error}"
            print(f"baton {name}: error: start-up failed: {what}", file=sys.stderr, flush=True)
        sys.exit(1)
