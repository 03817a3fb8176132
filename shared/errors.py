"""The project's exception tree.

Every error a user can cause or meet derives from :class:`BatonError`; services
translate these at their boundary (HTTP status + OpenAI error body, CLI exit
code and one-line message) instead of letting tracebacks escape.
"""

from __future__ import annotations


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


class InvalidRequestError(BatonError):
    """A request is malformed: empty prompt, bad sampling parameter, too long, ..."""


class RequestTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) does not fit in the model's context."""


class UnknownRequestError(BatonError):
    """An operation named a request id the engine does not know."""
