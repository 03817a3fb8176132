"""Running a service process: settings errors are one line, the app runs under uvicorn."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError

from shared.errors import BatonError
from shared.logs import configure_logging


def _settings_error(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "settings"
    return f"{where}: {first['msg']}"


def run_service(name: str, build: Callable[[], tuple[FastAPI, str, int]]) -> None:
    """Build the app from the environment and serve it until SIGINT/SIGTERM."""
    level = os.environ.get("BATON_LOG_LEVEL", "info").upper()
    configure_logging(name, level=level, fmt=os.environ.get("BATON_LOG_FORMAT", "json"))
    try:
        app, host, port = build()
    except ValidationError as exc:
        print(f"baton {name}: error: invalid setting {_settings_error(exc)}", file=sys.stderr)
        sys.exit(2)
    except BatonError as exc:
        print(f"baton {name}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    uvicorn.run(
        app, host=host, port=port, log_level=level.lower(), access_log=False, log_config=None
    )
