"""The HAProxy configuration of the balancer in front of the gateways.

Every gateway is checked with ``GET /ready`` each ``check_s`` and taken out after
two failures, back after one success. A connection that a gateway refuses (it
died) is retried on another at once (``retry-on conn-failure``, ``redispatch``);
a request already sent is never replayed (it might have started generating).
Streams are long: the client and server timeouts are the gateway's request
timeout. Nothing is buffered: server-sent events pass as they are written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BalancerConfig:
    port: int
    backends: Sequence[str]  # host:port of each gateway
    check_s: float = 1.0
    stream_timeout_s: float = 600.0
    host: str = "0.0.0.0"

    def render(self) -> str:
        if not self.backends:
            raise ValueError("the balancer needs at least one gateway")
        check_ms = int(self.check_s * 1000)
        timeout_ms = int(self.stream_timeout_s * 1000)
        servers = "\n".join(
            f"    server gateway-{i} {backend} check inter {check_ms} fall 2 rise 1"
            for i, backend in enumerate(self.backends)
        )
        return f"""global
    maxconn 4096

defaults
    mode http
    option http-keep-alive
    timeout connect 2s
    timeout client {timeout_ms}ms
    timeout server {timeout_ms}ms
    timeout http-request 30s
    timeout http-keep-alive 10s
    retries 3
    retry-on conn-failure empty-response
    option redispatch 1

frontend gateways
    bind {self.host}:{self.port}
    default_backend gateways

backend gateways
    balance roundrobin
    option httpchk GET /ready
    http-check expect status 200
{servers}
"""
