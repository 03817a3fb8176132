"""The cluster secret: what every internal call presents, and how services check it.

One secret per cluster (``BATON_CLUSTER_SECRET``, or a file named by
``BATON_CLUSTER_SECRET_FILE``; ``baton up`` generates one and hands it to its
children; compose's one-shot ``secret`` service leaves one in a volume the others
read, :func:`write_secret_file`; Kubernetes sets it from a Secret). It guards
the surfaces a client must never reach directly: the workers' ``/v1/...`` routes
(submitting prefill/decode work) and the KV store's data plane (writing or reading
KV blocks). Health, readiness, ``/stats`` and ``/metrics`` stay open for probes and
scrapers; they reveal no KV and accept no work.

- HTTP: the caller sends the secret in :data:`SECRET_HEADER`; the worker compares
  in constant time and refuses with 401 otherwise.
- Data plane: the first frame of a connection (``hello``) carries a proof, an
  HMAC-SHA256 under the secret of the client id, a fresh nonce and a timestamp;
  the secret itself never crosses the wire, and a recorded proof cannot be
  replayed (nonces are remembered for the freshness window). Until a valid hello,
  a connection gets one refusal and is closed.

With no secret configured a service serves its internal surfaces unauthenticated
and says so at start-up (a development setup).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.errors import ConfigError
from shared.serving.errors import error_body

log = logging.getLogger(__name__)

SECRET_HEADER = "X-Baton-Cluster-Secret"
PROTECTED_PREFIX = "/v1/"
FRESH_S = 60.0  # a hello proof older (or newer) than this is refused


def generate_secret() -> str:
    return secrets.token_urlsafe(32)


MIN_SECRET_CHARS = 16


def write_secret_file(path: Path, given: str | None) -> bool:
    """Leave the cluster secret in ``path`` for the services that read it through
    ``BATON_CLUSTER_SECRET_FILE`` (compose's one-shot ``secret`` service): ``given`` where
    one is (it replaces the file's), else the file's own where it has one (a restart
    keeps the cluster's secret), else a new one. Readable by its owner only; written
    whole or not at all. Returns whether the file changed."""
    given = given.strip() if given else None
    if given is not None and len(given) < MIN_SECRET_CHARS:
        raise ConfigError(f"BATON_CLUSTER_SECRET has fewer than {MIN_SECRET_CHARS} characters")
    try:
        current: str | None = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        current = None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    if given is None and current is not None and len(current) >= MIN_SECRET_CHARS:
        return False
    secret = given or generate_secret()
    if secret == current:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")
    os.replace(partial, path)
    return True


class AuthMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.refused = Counter(
            "baton_internal_auth_refused",
            "Internal calls refused for a missing or wrong cluster secret, by surface",
            ["surface"],
            registry=registry,
        )


@dataclass(frozen=True)
class HelloProof:
    nonce: str
    ts: float
    mac: str


def _mac(secret: str, client_id: str, nonce: str, ts: float) -> str:
    message = f"baton-kv-hello|{client_id}|{nonce}|{ts:.6f}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class ClusterSecret:
    """The secret as a service holds it (``None``: internal surfaces are open)."""

    value: str | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return bool(self.value)

    def warn_if_open(self, service: str) -> None:
        if not self.enabled:
            log.warning(
                "%s: no BATON_CLUSTER_SECRET set; internal routes and the KV data plane "
                "accept anyone who can reach them",
                service,
            )

    def headers(self) -> dict[str, str]:
        """Headers for an internal HTTP call."""
        return {SECRET_HEADER: self.value} if self.value else {}

    def accepts_header(self, presented: str | None) -> bool:
        if not self.value:
            return True
        return presented is not None and hmac.compare_digest(presented, self.value)

    def prove(self, client_id: str) -> HelloProof | None:
        """The proof a data-plane client puts in its hello (None when no secret is set)."""
        if not self.value:
            return None
        nonce, ts = secrets.token_hex(16), time.time()
        return HelloProof(nonce, ts, _mac(self.value, client_id, nonce, ts))


class ProofChecker:
    """Checks data-plane hello proofs, each nonce at most once within the freshness window."""

    def __init__(self, secret: ClusterSecret):
        self.secret = secret
        self._seen: dict[str, float] = {}

    def accepts(self, client_id: str, proof: HelloProof | None) -> bool:
        value = self.secret.value
        if not value:
            return True
        now = time.time()
        if proof is None or abs(now - proof.ts) > FRESH_S or proof.nonce in self._seen:
            return False
        if not hmac.compare_digest(proof.mac, _mac(value, client_id, proof.nonce, proof.ts)):
            return False
        self._forget_before(now - FRESH_S)
        self._seen[proof.nonce] = now
        return True

    def _forget_before(self, cutoff: float) -> None:
        if len(self._seen) > 4096:
            self._seen = {n: t for n, t in self._seen.items() if t >= cutoff}


class InternalAuthMiddleware:
    """Refuses (401) any ``/v1/...`` request of a worker without the cluster secret."""

    def __init__(self, app: ASGIApp, secret: ClusterSecret, metrics: AuthMetrics):
        self.app = app
        self.secret = secret
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        wanted = SECRET_HEADER.lower().encode()
        presented = next((v for k, v in scope["headers"] if k == wanted), None)
        if self.secret.accepts_header(presented.decode("latin-1") if presented else None):
            await self.app(scope, receive, send)
            return
        self.metrics.refused.labels("http").inc()
        log.warning("refused %s %s: no valid cluster secret", scope["method"], scope["path"])
        body = error_body(401, "this internal route needs the cluster secret", "unauthorized")
        await JSONResponse(body, status_code=401)(scope, receive, send)


def protect(app: FastAPI, secret: ClusterSecret, metrics: AuthMetrics) -> None:
    app.add_middleware(InternalAuthMiddleware, secret=secret, metrics=metrics)
