"""JSON log lines that carry the request id across every service.

The gateway assigns each request an id (or keeps the client's
``X-Request-Id``) and sends it on to prefill and decode in the same header;
each service puts it in :data:`request_id_var` for the request's task, so
every log line written while serving it names it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "baton_request_id", default=None
)


TRACEBACK = "Traceback (most recent call last):"


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a traceback goes in ``exc`` (``msg`` stays one line)."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        exc = self.formatException(record.exc_info) if record.exc_info else record.exc_text
        at = msg.find(TRACEBACK)
        if at >= 0:
            # a traceback formatted into the message (Starlette hands uvicorn a failed
            # lifespan that way): "msg" keeps the text before it, else the exception's
            # last line, and the traceback goes where tracebacks go
            head, text = msg[:at].strip(), msg[at:].rstrip()
            msg = head or text.splitlines()[-1]
            exc = f"{text}\n{exc}" if exc else text
        entry: dict[str, object] = {
            "ts": round(record.created, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": msg,
        }
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            entry["request_id"] = rid
        if exc:
            entry["exc"] = exc
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(service: str, *, level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
