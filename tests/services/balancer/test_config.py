"""The balancer's HAProxy configuration (pure): every gateway checked on /ready, refused
connections retried elsewhere, stream-long timeouts; and haproxy itself accepts it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from services.balancer.config import BalancerConfig


def test_every_gateway_is_health_checked_behind_one_port() -> None:
    text = BalancerConfig(8000, ["127.0.0.1:8500", "127.0.0.1:8501"], check_s=0.5).render()
    assert "bind 0.0.0.0:8000" in text
    assert "option httpchk GET /ready" in text
    assert "server gateway-0 127.0.0.1:8500 check inter 500 fall 2 rise 1" in text
    assert "server gateway-1 127.0.0.1:8501 check inter 500 fall 2 rise 1" in text
    assert "retry-on conn-failure" in text and "option redispatch" in text
    assert "timeout server 600000ms" in text  # a stream is as long as the gateway allows
    with pytest.raises(ValueError):
        BalancerConfig(8000, []).render()


def test_discovered_gateways_fill_slots_from_dns() -> None:
    """Compose: every replica the service name resolves to, followed as they come and go."""
    text = BalancerConfig(8000, discover="gateway:8000", max_discovered=4).render()
    assert "parse-resolv-conf" in text
    assert (
        "server-template gateway- 1-4 gateway:8000 check inter 1000 fall 2 rise 1 "
        "resolvers dns resolve-prefer ipv4 init-addr none"
    ) in text
    with pytest.raises(ValueError):  # listed or discovered, not both
        BalancerConfig(8000, ["127.0.0.1:8500"], discover="gateway:8000").render()


@pytest.mark.parametrize(
    "config",
    [BalancerConfig(8000, ["127.0.0.1:8500"]), BalancerConfig(8000, discover="gateway:8000")],
    ids=["listed", "discovered"],
)
def test_haproxy_accepts_the_configuration(tmp_path: Path, config: BalancerConfig) -> None:
    assert shutil.which("haproxy"), "scripts/install.sh installs haproxy (Debian's package)"
    path = tmp_path / "haproxy.cfg"
    path.write_text(config.render())
    check = subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
