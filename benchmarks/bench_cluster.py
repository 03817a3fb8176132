"""The local cluster the serving benchmarks run: every port free, UCX, one torch thread
per worker, service logs in a temporary folder (or kept under ``logs``, info level)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from shared.launcher import LocalCluster, Topology
from shared.procs import PortPicker


@contextmanager
def bench_cluster(
    logs: Path | None, name: str, env: dict[str, str], **topology: Any
) -> Iterator[LocalCluster]:
    """Start the cluster ``topology`` describes (Topology fields) and stop it after."""

    def make(redis_url: str) -> Topology:
        picker = PortPicker()
        base = Topology(
            redis_url=redis_url,
            gateway_port=picker(),
            ports=picker,
            transport="ucx",
            threads=1,
            dtype="float32",  # the benches compare with fp32 references and past figures
            extra_env={"BATON_LOG_LEVEL": "info" if logs else "warning", **env},
        )
        return replace(base, **topology)

    with tempfile.TemporaryDirectory(prefix=f"baton-{name}-") as scratch:
        folder = Path(scratch) if logs is None else logs / time.strftime("%H%M%S")
        folder.mkdir(parents=True, exist_ok=True)
        local = LocalCluster(make, log_dir=folder).start()
        try:
            yield local
        finally:
            local.stop()
