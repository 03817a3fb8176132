"""``python -m services.balancer``: HAProxy (Debian's ``haproxy``) in front of the
gateways, in the foreground. Settings: ``BATON_BALANCER_PORT`` and
``BATON_BALANCER_BACKENDS`` (comma-separated ``host:port`` of each gateway)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from services.balancer.config import BalancerConfig, compose_config


def main() -> None:
    if sys.argv[1:] == ["--compose-config"]:  # docker/haproxy.cfg
        sys.stdout.write(compose_config())
        return
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        sys.exit("baton balancer: haproxy is not installed (Debian: apt-get install haproxy)")
    backends = [b.strip() for b in os.environ.get("BATON_BALANCER_BACKENDS", "").split(",")]
    config = BalancerConfig(
        port=int(os.environ.get("BATON_BALANCER_PORT", "8000")),
        backends=[b for b in backends if b],
    )
    fd, path = tempfile.mkstemp(prefix="baton-haproxy-", suffix=".cfg")
    with os.fdopen(fd, "w") as f:
        f.write(config.render())
    # -db: stay in the foreground, logs to stderr; the launcher owns the process
    os.execv(haproxy, [haproxy, "-db", "-f", path])


if __name__ == "__main__":
    main()
