"""Errors at the HTTP boundary: project exceptions -> status + OpenAI-style error body.

Every service answers errors with ``{"error": {"message", "type", "param",
"code"}}`` (what OpenAI and vLLM send), so the gateway can pass a worker's
refusal through unchanged.
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from shared.errors import (
    BatonError,
    InvalidRequestError,
    KVNoSpaceError,
    KVStoreError,
    RequestTooLongError,
    TransportError,
)

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",  # what OpenAI sends for an unknown model or route
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ServiceError(BatonError):
    """An error with an HTTP status, raised at a service's edge."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        who: str | None = None,
    ):
        super().__init__(message)
        self.who = who  # the role whose failure this reports, when it is a worker's
        self.status = status
        self.code = code
        self.param = param
        self.headers = headers or {}


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "error"),
            "param": param,
            "code": code,
        }
    }


def classify(exc: BaseException) -> ServiceError:
    """The status a project exception maps to (anything unexpected is a logged 500)."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, RequestTooLongError):
        return ServiceError(400, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, InvalidRequestError):
        return ServiceError(400, str(exc), code="invalid_request")
    if isinstance(exc, KVNoSpaceError):
        return ServiceError(503, f"KV store full: {exc}", code="kv_no_space")
    if isinstance(exc, KVStoreError | TransportError):
        return ServiceError(503, f"KV store unavailable: {exc}", code="kv_unavailable")
    log.error("unexpected error", exc_info=exc)
    return ServiceError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def error_response(exc: BaseException) -> JSONResponse:
    err = classify(exc)
    return JSONResponse(
        error_body(err.status, str(err), err.code, err.param),
        status_code=err.status,
        headers=err.headers,
    )
