"""The gateway's status page in a real browser: headless Chromium loads ``/status`` from
the running cluster, the page's script fetches ``/status.json`` and renders every live
instance and the TTFT/TPOT sparklines; a screenshot is taken.

Skipped with the reason where Chromium is not installed (scripts/install-system.sh
installs Debian's ``chromium``)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from services.gateway.status_page import RecentLatencies
from shared.cli import main as cli_main
from shared.cluster.status import COLUMNS
from shared.config import BatonSettings
from shared.procs import RedisProcess, free_port
from tests.services.conftest import MODEL, Cluster

BROWSER_FLAGS = (
    "--headless",
    "--no-sandbox",  # as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",  # this machine's network is closed
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=8000",  # let the page fetch and render before the dump
)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path is not None:
            return path
    pytest.skip("Chromium is not installed: the status page was not rendered")


def browse(url: str, tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    profile = tmp / f"profile-{len(list(tmp.iterdir()))}"
    cmd = [chromium(), *BROWSER_FLAGS, f"--user-data-dir={profile}", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


def test_recent_latencies_keep_the_latest_requests() -> None:
    recent = RecentLatencies(size=3)
    for i in range(5):
        recent.record(0.1 * i, None if i == 4 else 0.01)
    assert recent.series() == {"ttft_ms": [200.0, 300.0, 400.0], "tpot_ms": [10.0, 10.0, None]}


def test_status_page_renders_every_instance_and_the_sparklines(
    cluster: Cluster, tmp_path: Path
) -> None:
    for i in range(3):
        r = httpx.post(
            cluster.url + "/v1/completions",
            json={"model": MODEL, "prompt": f"Status page request {i}", "max_tokens": 8},
            timeout=120,
        )
        assert r.status_code == 200
    data = httpx.get(cluster.url + "/status.json", timeout=10).json()
    assert data["columns"] == list(COLUMNS)
    roles = sorted(i["role"] for i in data["instances"])
    assert roles == ["decode", "decode", "kvstore", "prefill", "prefill"]
    assert len(data["ttft_ms"]) >= 3 and all(v > 0 for v in data["ttft_ms"])
    assert data["slo"]["ttft_s"] is None and data["slo"]["both_met"] is None  # no targets

    dom = browse(cluster.url + "/status", tmp_path, "--dump-dom").stdout
    shown = set(re.findall(r'data-instance="([^"]+)"', dom))
    assert shown == {i["instance"] for i in data["instances"]}
    for column in COLUMNS:
        assert f"<th>{column}</th>" in dom
    assert len(re.findall(r'<path class="line" d="M[\d.]+,[\d.]+L', dom)) == 2  # both drawn
    meta = re.search(r'<div id="meta"[^>]*>([^<]*)</div>', dom)
    assert meta is not None and f"{len(shown)} instances" in meta.group(1), meta
    assert '<div class="value" id="slo">no targets set</div>' in dom

    shot = tmp_path / "status.png"
    browse(cluster.url + "/status", tmp_path, f"--screenshot={shot}", "--window-size=1200,560")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one


def test_status_data_is_503_while_redis_is_unreachable() -> None:
    """A gateway whose Redis is down serves the page, and its data route answers 503
    with an OpenAI-style error body (the page shows "status unavailable"); neither
    route is part of the API schema."""
    settings = BatonSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    with TestClient(create_app(GatewaySettings(), settings)) as client:
        assert client.get("/status").status_code == 200
        r = client.get("/status.json")
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "redis_unavailable"
        assert not {"/status", "/status.json"} & set(client.get("/openapi.json").json()["paths"])


def test_slo_attainment_reaches_the_status_data_and_baton_status(
    redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """A gateway with targets publishes the last minute's attainment: ``/status.json``
    carries it and ``baton status`` prints it under the table (no worker needed)."""
    prefix = "slo-gateway"
    settings = BatonSettings(
        redis_url=redis_server.url, redis_prefix=prefix, slo_ttft=2.0, slo_tpot=0.25
    )
    gateway = GatewaySettings(refresh_s=0.05)
    with TestClient(create_app(gateway, settings)) as client:
        slo = client.get("/status.json").json()["slo"]
        assert (slo["ttft_s"], slo["tpot_s"], slo["requests"]) == (2.0, 0.25, 0)
        deadline = time.monotonic() + 5
        while True:
            assert cli_main(["status", "--redis-url", redis_server.url, "--prefix", prefix]) == 1
            out = capsys.readouterr().out
            if "SLO" in out or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert "SLO TTFT <= 2 s, TPOT <= 0.25 s: no request in the last 60 s" in out
