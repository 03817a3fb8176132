"""Bad input and missing capacity: the right status and an OpenAI error body, never a
500 or a hang; and a client that goes away leaves no KV or lease anywhere."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.procs import ServiceProcess, free_port
from tests.services.conftest import FAST_HEARTBEAT, MODEL, Cluster

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    return dict(err)


def chat(**over: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **over}


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        (CHAT, b"{not json", 400, "invalid_request"),
        (CHAT, b"[]", 400, "invalid_request"),
        (CHAT, chat(model="gpt-17"), 404, "model_not_found"),
        (CHAT, chat(max_tokens=-3), 400, "invalid_request"),
        (CHAT, chat(max_tokens=0), 400, "invalid_request"),
        (CHAT, chat(temperature=-1), 400, "invalid_request"),
        (CHAT, chat(top_p=0), 400, "invalid_request"),
        (CHAT, chat(n=17), 400, "invalid_request"),
        (CHAT, chat(messages=[]), 400, "invalid_request"),
        (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "invalid_request"),
        (CHAT, chat(top_logprobs=3), 400, "invalid_request"),
        (CHAT, chat(stop=[""]), 400, "invalid_request"),
        (CHAT, chat(max_tokens=9000), 400, "context_length_exceeded"),
        (COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, "invalid_request"),
        (COMPLETIONS, {"model": MODEL, "prompt": [1] * 8300}, 400, "context_length_exceeded"),
        (COMPLETIONS, {"model": MODEL, "prompt": [99999999]}, 400, "invalid_request"),
        (
            COMPLETIONS,
            {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1},
            400,
            "invalid_request",
        ),
    ],
)
def test_bad_requests(cluster: Cluster, path: str, body: Any, status: int, code: str) -> None:
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(cluster.url + path, timeout=30, **kwargs)
    assert_error(r, status, code)


def test_oversized_body_and_unknown_routes(cluster: Cluster) -> None:
    big = {"model": MODEL, "prompt": "word " * 300_000}
    assert_error(httpx.post(cluster.url + COMPLETIONS, json=big, timeout=30), 413)
    assert_error(httpx.get(cluster.url + "/v1/nothing", timeout=5), 404)
    assert_error(httpx.get(cluster.url + CHAT, timeout=5), 405)


def _store_stats(cluster: Cluster) -> dict[str, float]:
    return cluster.stats("kvstore")[0]


def _wait_idle(cluster: Cluster, timeout_s: float = 30.0) -> None:
    """Every worker has no request and no KV in use; the store has no lease or reservation."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        workers = cluster.stats("prefill") + cluster.stats("decode")
        store = _store_stats(cluster)
        last = (workers, store)
        if (
            all(w["in_flight"] == 0 and w["kv_usage"] == 0 for w in workers)
            and store["leases"] == 0
            and store["blocks_reserved"] == 0
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"cluster did not return to idle: {last}")


@pytest.mark.parametrize("after_chunks", [1, 3])
def test_client_disconnect_mid_stream_frees_everything(cluster: Cluster, after_chunks: int) -> None:
    """Leaving after the first chunk (the gateway may still be handing that token
    to decode) or a few tokens later."""
    body = chat(max_tokens=400, ignore_eos=True, stream=True, temperature=0)
    with httpx.stream("POST", cluster.url + CHAT, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        chunks = 0
        while chunks < after_chunks:
            chunks += next(lines).startswith("data: ")
        # decode holds the request's KV right now (leaving the loop would close the stream)
        assert sum(w["in_flight"] for w in cluster.stats("decode")) == 1
        assert sum(w["kv_usage"] for w in cluster.stats("decode")) > 0
    _wait_idle(cluster)
    r = httpx.post(cluster.url + CHAT, json=chat(max_tokens=2), timeout=60)
    assert r.status_code == 200


def test_client_disconnect_during_prefill_frees_everything(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": "tick " * 1500, "max_tokens": 50, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.url + COMPLETIONS, json=body, timeout=0.3)
    _wait_idle(cluster)
    # the cluster still serves
    r = httpx.post(
        cluster.url + COMPLETIONS, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    )
    assert r.status_code == 200


@pytest.fixture
def lonely_gateway(cluster: Cluster, tmp_path: Path) -> Iterator[str]:
    """A gateway with API keys, on a Redis prefix where no worker lives."""
    port = free_port()
    env = {
        "BATON_REDIS_URL": cluster.local.redis.url,
        "BATON_REDIS_PREFIX": "nobody-home",
        "BATON_GATEWAY_PORT": str(port),
        "BATON_GATEWAY_API_KEYS": "key-one,key-two",
        "BATON_LOG_LEVEL": "warning",
        **FAST_HEARTBEAT,
    }
    yield from run_gateway(env, port, tmp_path, ready="/health")


def run_gateway(env: dict[str, str], port: int, tmp_path: Path, *, ready: str) -> Iterator[str]:
    """A gateway process with ``env``, up until the generator is closed."""
    url = f"http://127.0.0.1:{port}"
    proc = ServiceProcess("services.gateway", env, url + ready, tmp_path / "gw.log")
    proc.start().wait_ready(60)
    try:
        yield url
    finally:
        proc.stop()


def test_api_keys_and_no_live_instances(lonely_gateway: str) -> None:
    url = lonely_gateway
    assert_error(httpx.post(url + CHAT, json=chat(), timeout=10), 401, "invalid_api_key")
    wrong = {"Authorization": "Bearer nope"}
    assert_error(httpx.post(url + CHAT, json=chat(), headers=wrong, timeout=10), 401)
    assert_error(httpx.get(url + "/v1/models", timeout=10), 401)
    ok = {"Authorization": "Bearer key-two"}
    assert httpx.get(url + "/v1/models", headers=ok, timeout=10).status_code == 200
    err = assert_error(
        httpx.post(url + CHAT, json=chat(), headers=ok, timeout=10), 503, "no_live_instance"
    )
    assert "prefill" in err["message"]
    ready = httpx.get(url + "/ready", timeout=10)
    assert ready.status_code == 503 and ready.json()["prefill"] == 0


@pytest.fixture
def strict_gateway(cluster: Cluster, tmp_path: Path) -> Iterator[str]:
    """A second gateway over the same live workers, with tight backpressure bounds."""
    port = free_port()
    env = {
        "BATON_REDIS_URL": cluster.local.redis.url,
        "BATON_GATEWAY_PORT": str(port),
        "BATON_GATEWAY_MAX_IN_FLIGHT": "1",
        "BATON_GATEWAY_MAX_PENDING_PROMPT_TOKENS": "200",
        **FAST_HEARTBEAT,
        **cluster.local.secret_env(),  # it calls the cluster's workers
    }
    yield from run_gateway(env, port, tmp_path, ready="/ready")


def test_backpressure_is_429_with_retry_after(strict_gateway: str) -> None:
    url = strict_gateway
    long_prompt = {"model": MODEL, "prompt": [500] * 300, "max_tokens": 2}
    r = httpx.post(url + COMPLETIONS, json=long_prompt, timeout=30)
    assert_error(r, 429, "overloaded")
    assert r.headers["retry-after"] == "1"
    body = chat(max_tokens=200, ignore_eos=True, stream=True)
    with httpx.stream("POST", url + CHAT, json=body, timeout=60) as first:
        assert first.status_code == 200
        second = httpx.post(url + CHAT, json=chat(max_tokens=2), timeout=30)
        assert_error(second, 429, "overloaded")
    # once the first is gone, the gateway takes requests again
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        again = httpx.post(url + CHAT, json=chat(max_tokens=2), timeout=60)
        if again.status_code == 200:
            break
        time.sleep(0.2)
    assert again.status_code == 200
