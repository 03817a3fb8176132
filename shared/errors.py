"""The project's exception tree.

Every error a user can cause or meet derives from :class:`BatonError`; services
translate these at their boundary (HTTP status + OpenAI error body, CLI exit
code and one-line message) instead of letting tracebacks escape.
"""

from __future__ import annotations

from collections.abc import Sequence


class BatonError(Exception):
    """Base of every error Baton raises on purpose."""


class ModelError(BatonError):
    """The model could not be found, read or run."""


class ModelNotFoundError(ModelError):
    """The model path does not exist or holds no recognisable model."""


class ModelFormatError(ModelError):
    """The model file exists but is corrupt or truncated."""


class UnsupportedModelError(ModelError):
    """The model is readable but uses an architecture/quantization we do not implement."""


class ModelPullError(ModelError):
    """Fetching the default model from the package registry failed."""


class ConfigError(BatonError):
    """A setting is invalid or unsupported on this machine (e.g. float16 on CPU)."""


class PortInUseError(ConfigError):
    """Another socket listens on a port Baton must listen on (one in TIME_WAIT does not)."""

    def __init__(self, port: int, what: str = ""):
        super().__init__(f"port {port}{f' ({what})' if what else ''} is already in use")
        self.port = port
        self.what = what


class KernelBuildError(BatonError):
    """A native CPU kernel could not be compiled or loaded (no compiler, compile failed)."""


class InvalidRequestError(BatonError):
    """A request is malformed: empty prompt, bad sampling parameter, too long, ..."""


class RequestTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit in the model's context."""


class UnknownRequestError(BatonError):
    """An operation named a request id the engine does not know."""


class TransportError(BatonError):
    """A data-plane connection failed: refused, lost, timed out or spoke garbage."""


class PeerLostError(TransportError):
    """The peer closed or vanished; every operation pending on the connection gets this."""


class TransportTimeoutError(TransportError):
    """A data-plane operation did not finish within its bound; the connection is closed."""


class ProtocolError(TransportError):
    """The peer sent bytes that are not a valid frame (wrong magic, sizes over the limits)."""


class KVStoreError(BatonError):
    """A KV store operation was refused; ``code`` is the wire error code."""

    code = "error"

    def __init__(self, message: str, ids: Sequence[str] = ()):
        super().__init__(message)
        self.ids = list(ids)


class KVMissError(KVStoreError):
    """Some requested block ids are not held (never written, evicted, or revoked)."""

    code = "miss"


class KVNoSpaceError(KVStoreError):
    """The store cannot make room: everything is leased or being written."""

    code = "no_space"


class KVWaitTimeoutError(KVStoreError):
    """Blocks being written did not complete within the reader's wait bound."""

    code = "timeout"


class KVBadRequestError(KVStoreError):
    """The request is malformed: wrong sizes, unknown op, oversized put, bad layer range."""

    code = "bad_request"


class KVUnauthorizedError(KVStoreError):
    """The connection did not prove the cluster secret (missing, wrong or replayed)."""

    code = "unauthorized"


class KVUnavailableError(KVStoreError):
    """No live store node could serve the operation."""

    code = "unavailable"
