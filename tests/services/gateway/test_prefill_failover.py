"""A prefill instance that dies before the first token: the gateway starts the request
over on another prefill instance, and the client gets exactly the tokens of a
failure-free run (nothing had been sent to it yet)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from shared.engine.sampling_params import SamplingParams
from tests.conftest import EngineFactory
from tests.services.conftest import MODEL, serving_reference, start_cluster


def test_prefill_killed_mid_prompt_is_retried_elsewhere(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    local = start_cluster(tmp_path, prefill=2, decode=1)
    prompt = [300 + (i * 13) % 30000 for i in range(1500)]  # seconds of prefill here
    result: dict[str, Any] = {}

    def run() -> None:
        r = httpx.post(
            local.gateway_url + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=300,
        )
        result["status"], result["body"] = r.status_code, r.json()

    try:
        client = threading.Thread(target=run)
        client.start()
        victim = None
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            for spec in local.specs:
                if spec.role != "prefill":
                    continue
                stats = httpx.get(f"http://127.0.0.1:{spec.http_port}/stats", timeout=5).json()
                if stats["in_flight"] and stats["steps"] == 0:  # computing the prompt now
                    victim = spec.name
            time.sleep(0.05)
        assert victim is not None, "the prompt never reached a prefill instance"
        local.procs[victim].kill()
        client.join(300)
        store = next(s for s in local.specs if s.role == "kvstore")
        store_stats = httpx.get(f"http://127.0.0.1:{store.http_port}/stats", timeout=5).json()
    finally:
        local.stop()
    assert result["status"] == 200, result
    ref = serving_reference(make_engine, kv_cache_bytes=256 << 20).generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    assert result["body"]["choices"][0]["token_ids"] == ref.token_ids
    assert store_stats["blocks_reserved"] == 0  # the dead writer's reservation was freed
