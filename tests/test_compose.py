"""docker-compose.yml run for real on this machine's Docker engine.

The images are built with ``scripts/docker-build.sh`` (a local Debian base where no
registry is reachable), the cluster is started with ``docker compose up``, and:

- a streamed chat and greedy and seeded completions through the published gateway
  equal the in-process engine token for token;
- ``--scale prefill=2 --scale decode=3`` registers every replica under its own
  container address and requests are served by every decode replica;
- scaling decode back down while streams run (Compose stops the removed replica with
  SIGTERM: it drains and its streams move) breaks no stream;
- nothing is exported: the cluster secret is the one the one-shot ``secret`` service
  made, and every role demands it;
- with ``--scale gateway=2`` behind the balancer, a gateway container killed
  mid-stream loses no resumable stream: the client reconnects through the balancer
  with ``Last-Event-ID`` and gets the rest, token-exact;
- ``down`` leaves no container and no network behind.

Where no Docker engine runs, the test starts ``dockerd`` itself (as root) and stops it
afterwards; where none can be started, the module is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest

from services.prefill.prefiller import PREFILL_CHUNK_TOKENS
from shared.bench.chaos import (
    ChaosRequest,
    SteadyLoad,
    StreamResult,
    broken,
    make_requests,
    reference,
    stream,
)
from shared.bench.scrape import metric_sum
from shared.cluster.auth import SECRET_HEADER
from shared.config import BatonSettings, EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.launcher import COMPOSE_SECRET_FILE
from shared.model.loader import load_model
from shared.procs import free_port
from shared.serving.protocol import GATEWAY_HEADER
from tests.conftest import CHAT_FRANCE
from tests.services.conftest import MODEL

ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 1500
ROLE_PORTS = {"prefill": 8100, "decode": 8200, "kvstore": 8300}


def _run(cmd: list[str], timeout: float = 60, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]


def _engine_answers(docker: str) -> bool:
    try:
        return _run([docker, "info"], timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture(scope="module")
def docker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A docker client whose engine answers; starts ``dockerd`` where none runs."""
    client = shutil.which("docker")
    if client is None:
        pytest.skip("no docker client: install docker.io (scripts/install-system.sh)")
    if _engine_answers(client):
        yield client
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None or os.geteuid() != 0:
        pytest.skip("no Docker engine runs and none can be started here (no dockerd, or not root)")
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [dockerd], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 60
    while not _engine_answers(client):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.terminate()
            tail = log.read_text(errors="replace")[-600:]
            pytest.skip(f"dockerd could not be started here: {tail}")
        time.sleep(0.5)
    try:
        yield client
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def compose_command(docker: str) -> list[str]:
    legacy = shutil.which("docker-compose")
    if legacy is not None:
        return [legacy]
    if _run([docker, "compose", "version"]).returncode == 0:
        return [docker, "compose"]
    pytest.skip("neither docker-compose nor the compose plugin is installed")


@pytest.fixture(scope="module")
def images(docker: str) -> None:
    proc = _run(["bash", "scripts/docker-build.sh"], timeout=BUILD_TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@dataclass
class Compose:
    docker: str
    command: list[str]
    env: dict[str, str]
    url: str

    def __call__(self, *args: str, timeout: float = 300) -> str:
        proc = _run([*self.command, *args], timeout=timeout, cwd=ROOT, env=self.env)
        assert proc.returncode == 0, f"compose {' '.join(args)}: {proc.stderr[-2000:]}"
        return proc.stdout

    @property
    def project(self) -> str:
        return self.env["COMPOSE_PROJECT_NAME"]

    def containers(self, role: str | None = None) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        cmd = [self.docker, "ps", "-aq", "--filter", label]
        if role is not None:
            cmd += ["--filter", f"label=com.docker.compose.service={role}"]
        return _run(cmd).stdout.split()

    def stats(self, container: str, role: str) -> dict[str, float]:
        """The instance's /stats, read inside its container (no host port is published)."""
        stats: dict[str, float] = json.loads(self.inside(container, ROLE_PORTS[role], "/stats"))
        return stats

    def inside(self, container: str, port: int, path: str) -> str:
        """GET ``path`` on ``port`` inside ``container``: the body (raises on an error)."""
        body = self.try_inside(container, port, path)
        assert body is not None, f"{container}: GET {path} failed"
        return body

    def try_inside(self, container: str, port: int, path: str) -> str | None:
        code = (
            "import sys, urllib.request as u; "
            f"sys.stdout.write(u.urlopen('http://127.0.0.1:{port}{path}').read().decode())"
        )
        out = _run([self.docker, "exec", container, "python", "-c", code])
        return out.stdout if out.returncode == 0 else None

    def wait_ready(self, prefill: int, decode: int, timeout_s: float = 240) -> dict[str, object]:
        deadline = time.monotonic() + timeout_s
        body: dict[str, object] = {}
        while time.monotonic() < deadline:
            try:
                body = httpx.get(self.url + "/ready", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                body = {}
            if body.get("prefill") == prefill and body.get("decode") == decode:
                return body
            time.sleep(1)
        raise AssertionError(f"the cluster never had {prefill}+{decode} live instances: {body}")


@pytest.fixture(scope="module")
def cluster(docker: str, images: None) -> Iterator[Compose]:
    port = free_port()
    env = {  # `docker compose up` as typed: no secret exported
        **{k: v for k, v in os.environ.items() if k != "BATON_CLUSTER_SECRET"},
        "COMPOSE_PROJECT_NAME": f"batontest{os.getpid()}",
        "BATON_GATEWAY_PUBLISH": str(port),
    }
    compose = Compose(docker, compose_command(docker), env, f"http://127.0.0.1:{port}")
    try:
        compose("up", "-d", "--no-build")
        compose.wait_ready(prefill=1, decode=1)
        yield compose
    finally:
        compose("down", "--volumes", "--remove-orphans", "--timeout", "30")


@pytest.fixture(scope="module")
def engine(cache_dir: Path) -> Engine:
    """The in-process engine the containers must match: the default dtype resolved on
    this host (the containers resolve it on the same CPU) and the prefill service's
    prompt chunking."""
    dtype = BatonSettings().resolved_dtype()
    loaded = load_model(None, cache_dir=cache_dir, dtype=dtype, progress=False)
    config = EngineConfig(
        scheduler=SchedulerConfig(long_prefill_token_threshold=PREFILL_CHUNK_TOKENS)
    )
    return Engine(loaded, replace(config, dtype=dtype))


def requests(n: int, seed: int, max_tokens: int = 48) -> list[ChaosRequest]:
    return make_requests(random.Random(seed), n, prompt_len=(40, 300), max_tokens=max_tokens)


async def stream_all(url: str, reqs: list[ChaosRequest]) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=300) as http:
        results = await asyncio.gather(*(stream(http, url, MODEL, r) for r in reqs))
    assert [r.error for r in results if r.error] == []
    return [r.tokens for r in results]


def test_streamed_chat_and_completions_equal_the_in_process_engine(
    cluster: Compose, engine: Engine
) -> None:
    body = {
        "model": MODEL,
        "messages": CHAT_FRANCE,
        "temperature": 0,
        "max_tokens": 32,
        "stream": True,
        "return_token_ids": True,
    }
    got: list[int] = []
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    got += choice.get("token_ids") or []
    prompt = engine.tokenizer.encode_chat(CHAT_FRANCE)
    want = engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert got == want.token_ids
    assert "Paris" in engine.tokenizer.decode(got)

    reqs = requests(4, seed=1)  # two greedy, two seeded
    assert asyncio.run(stream_all(cluster.url, reqs)) == reference(engine, reqs)


def test_scaled_replicas_register_their_own_addresses_and_all_serve(
    cluster: Compose, engine: Engine
) -> None:
    cluster("up", "-d", "--no-build", "--scale", "prefill=2", "--scale", "decode=3")
    cluster.wait_ready(prefill=2, decode=3)
    decoders = cluster.containers("decode")
    assert len(decoders) == 3
    before = {c: cluster.stats(c, "decode")["steps"] for c in decoders}
    reqs = requests(12, seed=2)
    assert asyncio.run(stream_all(cluster.url, reqs)) == reference(engine, reqs)
    served = {c: cluster.stats(c, "decode")["steps"] - before[c] for c in decoders}
    assert all(steps > 0 for steps in served.values()), served


@dataclass
class ScaleDown:
    results: list[StreamResult]
    removed: list[str]  # the decode containers Compose removed
    held: dict[str, float]  # streams each decode replica held when one was removed


async def _scale_down_under_load(cluster: Compose, reqs: list[ChaosRequest]) -> ScaleDown:
    """Keep 6 streams going while Compose removes one of the three decode replicas."""
    async with httpx.AsyncClient(timeout=300) as http:
        load = SteadyLoad(http, cluster.url, MODEL, iter(reqs), concurrency=6)
        decoders = cluster.containers("decode")
        held: dict[str, float] = {}
        deadline = time.monotonic() + 120
        while not (held and all(held.values())) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            stats = await asyncio.gather(
                *(asyncio.to_thread(cluster.stats, c, "decode") for c in decoders)
            )
            held = {c: s["running"] for c, s in zip(decoders, stats, strict=True)}
        await asyncio.to_thread(cluster, "up", "-d", "--no-build", "--scale", "decode=2")
        results = await load.stop()
    removed = sorted(set(decoders) - set(cluster.containers("decode")))
    return ScaleDown(results, removed, held)


def test_removing_a_decode_replica_under_load_breaks_no_stream(
    cluster: Compose, engine: Engine
) -> None:
    cluster("up", "-d", "--no-build", "--scale", "prefill=2", "--scale", "decode=3")
    cluster.wait_ready(prefill=2, decode=3)
    migrated = metric_sum(cluster.url, "baton_failovers_total", 'reason="migrated"')
    run = asyncio.run(_scale_down_under_load(cluster, requests(40, seed=3, max_tokens=160)))
    assert len(run.removed) == 1
    assert run.held[run.removed[0]] > 0, run.held  # the removed replica was streaming
    assert broken(run.results, reference(engine, [r.request for r in run.results])) == []
    assert metric_sum(cluster.url, "baton_failovers_total", 'reason="migrated"') > migrated


def test_the_secret_made_by_the_one_shot_service_guards_every_role(cluster: Compose) -> None:
    """Nothing was exported, yet every role runs with the secret the `secret` service left
    in the volume: a worker's internal route refuses a call without it (401) and takes
    one with it."""
    (prefill,) = cluster.containers("prefill")[:1]
    secret = _run([cluster.docker, "exec", prefill, "cat", COMPOSE_SECRET_FILE]).stdout.strip()
    assert len(secret) >= 16
    code = (
        "import urllib.request as u, urllib.error as e\n"
        "try:\n"
        "    u.urlopen(u.Request('http://127.0.0.1:8100/v1/prefill', data=b'{}', "
        "headers={'content-type': 'application/json'}))\n"
        "except e.HTTPError as x:\n"
        "    print(x.code)\n"
    )
    refused = _run([cluster.docker, "exec", prefill, "python", "-c", code])
    assert refused.stdout.strip() == "401", refused.stdout + refused.stderr
    with_secret = code.replace(
        "'content-type': 'application/json'",
        f"'content-type': 'application/json', {SECRET_HEADER!r}: {secret!r}",
    )
    taken = _run([cluster.docker, "exec", prefill, "python", "-c", with_secret])
    assert taken.stdout.strip() == "422", taken.stdout + taken.stderr  # past auth: bad body


def _open_resumable(url: str, prompt: list[int], seed: int | None, n: int) -> ResumableStart:
    """A resumable stream through the balancer, read for ``n`` events, then dropped."""
    payload = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 160,
        "temperature": 0.0 if seed is None else 0.8,
        "seed": seed,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"resumable": True},
    }
    seen: list[tuple[int, str]] = []
    with httpx.stream("POST", url + "/v1/completions", json=payload, timeout=120) as r:
        assert r.status_code == 200, r.read()
        owner = r.headers[GATEWAY_HEADER]
        for seq, data in _sse(r.iter_lines()):
            seen.append((seq, data))
            if len(seen) == n:
                break
    return ResumableStart(json.loads(seen[0][1])["id"], owner, seen, prompt, seed)


@dataclass
class ResumableStart:
    response_id: str
    owner: str  # the gateway instance that produced it
    seen: list[tuple[int, str]]  # (sequence number, data) of the events read
    prompt: list[int]
    seed: int | None


def _sse(lines: Iterator[str]) -> Iterator[tuple[int, str]]:
    seq, data = -1, ""
    for line in lines:
        if line.startswith("id: "):
            seq = int(line[4:])
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and data:
            yield seq, data
            seq, data = -1, ""


def _tokens(events: list[tuple[int, str]]) -> list[int]:
    out: list[int] = []
    for _, data in events:
        if data != "[DONE]":
            for choice in json.loads(data).get("choices", []):
                out += choice.get("token_ids") or []
    return out


def test_a_gateway_killed_mid_stream_loses_no_resumable_stream(
    cluster: Compose, engine: Engine
) -> None:
    """Two gateways behind the balancer; four resumable streams (greedy and seeded) read
    part way; the gateway that produced the first is killed (SIGKILL); each client
    reconnects through the balancer with Last-Event-ID and gets exactly the events it
    had not seen, with the in-process engine's tokens."""
    cluster("up", "-d", "--no-build", "--scale", "gateway=2")
    gateways = cluster.containers("gateway")
    assert len(gateways) == 2
    deadline = time.monotonic() + 120
    ids: dict[str, str] = {}
    while len(ids) < 2:  # the new replica started and answers
        assert time.monotonic() < deadline, f"the gateways never answered: {ids}"
        for c in gateways:
            body = cluster.try_inside(c, 8000, "/ready")
            if body is not None:
                ids[json.loads(body)["gateway"]] = c
        time.sleep(0.5)
    while (
        len({httpx.get(cluster.url + "/ready", timeout=5).json()["gateway"] for _ in range(6)}) < 2
    ):
        assert time.monotonic() < deadline, "the balancer never sent requests to both gateways"
        time.sleep(1)
    rng = random.Random(5)
    starts = [
        _open_resumable(cluster.url, [rng.randrange(100, 40000) for _ in range(60)], seed, n=8)
        for seed in (None, 7, None, 11)
    ]
    victim = ids[starts[0].owner]
    assert _run([cluster.docker, "kill", victim]).returncode == 0
    for start in starts:
        last = start.seen[-1][0]
        path = f"{cluster.url}/v1/completions/{start.response_id}/stream"
        with httpx.stream("GET", path, headers={"Last-Event-ID": str(last)}, timeout=180) as r:
            assert r.status_code == 200, r.read()
            rest = list(_sse(r.iter_lines()))
        assert [s for s, _ in rest] == list(range(last + 1, last + 1 + len(rest)))
        assert rest[-1][1] == "[DONE]"
        params = SamplingParams(
            max_tokens=160,
            temperature=0.0 if start.seed is None else 0.8,
            seed=start.seed,
            ignore_eos=True,
        )
        want = engine.generate([start.prompt], params)[0].token_ids
        assert _tokens(start.seen + rest) == list(want)


def test_down_leaves_no_container_or_network(cluster: Compose) -> None:
    t0 = time.monotonic()
    cluster("down", "--volumes", "--remove-orphans", "--timeout", "30")
    took = time.monotonic() - t0
    assert cluster.containers() == []
    nets = _run([cluster.docker, "network", "ls", "-q", "--filter", f"name={cluster.project}"])
    assert nets.stdout.split() == []
    assert took < 45, f"down took {took:.1f} s"
