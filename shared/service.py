"""Running a service process: settings errors are one line, the app runs under uvicorn,
and its long-lived part is built, started and stopped by the app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from types import FrameType
from typing import Protocol, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from pydantic import ValidationError

from shared.errors import BatonError
from shared.logs import configure_logging


class Component(Protocol):
    """A service's long-lived part (clients, engine, listeners)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


GRACEFUL_SHUTDOWN_S = 5
DRAIN_LIMIT_S = 120.0  # past every drain timeout: a stuck drain never keeps a process up


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


C = TypeVar("C", bound=Component)


def service_app(title: str, build: Callable[[], Awaitable[Component]]) -> FastAPI:
    """A FastAPI app whose lifespan builds and starts the component (created once, then
    injected into handlers through :func:`component_of`) and stops it on shutdown;
    ``/health`` answers as soon as the process serves HTTP."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        component = await build()
        await component.start()
        app.state.component = component
        try:
            yield
        finally:
            await component.stop()

    app = FastAPI(title=title, lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def component_of(request: Request, kind: type[C]) -> C:
    component = request.app.state.component
    if not isinstance(component, kind):
        raise TypeError(f"this app serves a {type(component).__name__}, not a {kind.__name__}")
    return component


def _settings_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "settings"
    return f"{where}: {first['msg']}"


def run_service(name: str, build: Callable[[], tuple[FastAPI, str, int]]) -> None:
    """Build the app from the environment and serve it until SIGINT/SIGTERM."""
    # a crash in native code (kernels, UCX) prints every thread's Python stack to
    # stderr, which is the service's log, instead of ending the log mid-line
    faulthandler.enable()
    level = os.environ.get("BATON_LOG_LEVEL", "info").upper()
    configure_logging(name, level=level, fmt=os.environ.get("BATON_LOG_FORMAT", "json"))
    cpus = os.environ.get("BATON_CPUS")
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
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=level.lower(),
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,  # after a drain: streams left are cut
    )
    _DrainingServer(config, app).run()
