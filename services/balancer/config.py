"""The HAProxy configuration of the balancer in front of the gateways.

Every gateway is checked with ``GET /ready`` each ``check_s`` and taken out after
two failures, back after one success. A connection that a gateway refuses (it
died) is retried on another at once (``retry-on conn-failure``, ``redispatch``);
a request already sent is never replayed (it might have started generating).
Streams are long: the client and server timeouts are the gateway's request
timeout. Nothing is buffered: server-sent events pass as they are written.

The gateways are listed (``baton up --gateways N``) or found by a DNS name that
resolves to each of them (compose's service name, however many replicas
``--scale gateway=N`` starts): HAProxy then fills up to ``max_discovered`` slots
from the resolver ``/etc/resolv.conf`` names, and follows the replicas as they come
and go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BalancerConfig:
    port: int
    backends: Sequence[str] = ()  # host:port of each gateway
    discover: str | None = None  # or host:port, the host a DNS name of every gateway
    max_discovered: int = 16
    check_s: float = 1.0
    stream_timeout_s: float = 600.0
    host: str = "0.0.0.0"

    def render(self) -> str:
        if bool(self.backends) == (self.discover is not None):
            raise ValueError("the balancer needs its gateways listed, or a name to find them")
        check = f"check inter {int(self.check_s * 1000)} fall 2 rise 1"
        timeout_ms = int(self.stream_timeout_s * 1000)
        resolvers = ""
        if self.discover is not None:
            # a replica's address is looked up again every second; one gone is dropped
            # once the name stops resolving to it (hold obsolete)
            resolvers = """
resolvers dns
    parse-resolv-conf
    resolve_retries 3
    timeout resolve 1s
    timeout retry 1s
    hold valid 1s
    hold obsolete 5s
"""
            servers = (
                f"    server-template gateway- 1-{self.max_discovered} {self.discover} "
                f"{check} resolvers dns resolve-prefer ipv4 init-addr none"
            )
        else:
            servers = "\n".join(
                f"    server gateway-{i} {backend} {check}"
                for i, backend in enumerate(self.backends)
            )
        return f"""global
    maxconn 4096
{resolvers}
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


# the compose balancer (docker/haproxy.cfg holds this rendering; a test checks it)
COMPOSE_CONFIG_HEADER = """\
# The compose balancer's HAProxy configuration: every `gateway` replica, found by
# Docker's DNS. Rendered from services/balancer/config.py by
#   python -m services.balancer --compose-config > docker/haproxy.cfg
# (tests/test_deployment.py checks this file is exactly that rendering).
"""


def compose_config() -> str:
    return COMPOSE_CONFIG_HEADER + BalancerConfig(8000, discover="gateway:8000").render()
