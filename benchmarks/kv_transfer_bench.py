"""KV store data-plane throughput and latency, against raw TCP and memcpy, in one run.

    python -m benchmarks.kv_transfer_bench [--mb 64] [--repeats 7] [--paths ucx tcp shm]
                                           [--block-bytes 737280] [--torch-rows]
                                           [--out FILE]

Measures, alternating the configurations in every repeat (the machine is
noisy, so only ratios taken side by side mean anything):

- ``memcpy``: one 64 MB numpy copy in this process;
- ``raw_tcp``: a plain blocking TCP socket pair between this process and a
  child process, 64 MB each way (the baseline the issue asks to reach 0.8x of);
- ``put``/``get`` through a real KV store process (real redis-server, the
  client library's one-round-trip put and whole-block get) for each data path,
  64 MB as blocks of the default model's fp32 block size (737,280 bytes);
- ``put_layers``/``stream``: the same bytes written layer by layer (begin_put,
  one write per layer for all blocks, commit; what prefill does) and read back
  as a layer stream (what decode does);
- p50/p99 latency of a single-block get;
- the same operations per block in microseconds (``--block-bytes 3840``: blocks so
  small that the figure is the client's and the store's bookkeeping, not bytes);
  ``--torch-rows``: the blocks are rows of one CPU tensor, as a CPU pool's are when a
  prefill puts them, instead of numpy arrays;
- where CUDA is present, host-to-GPU and back from a shared arena pinned in
  place (what a GPU client on the store's host would DMA from) against pageable
  memory.

Data paths: ``tcp`` and ``ucx`` move the bytes through the socket (the store's
arena not shared); ``shm`` is a same-host client copying to and from the
store's /dev/shm arena itself, control messages over TCP.

Prints a JSON report; ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from benchmarks.results import save_json
from services.kvstore.arena import cuda_present
from shared.cluster.keys import Keys
from shared.hardware import cpu_model
from shared.kvstore.client import KVStoreClient
from shared.procs import RedisProcess, ServiceProcess, free_port, free_ports
from shared.transport import make_transport

KINDS = ("put", "get", "put_layers", "stream")
BLOCK_BYTES = 737_280  # SmolLM2-135M fp32: 30 layers x 2 x 16 tokens x 3 heads x 64 x 4 B
NUM_LAYERS = 30
CHUNK = 4 << 20


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(CHUNK, len(view) - got))
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def raw_server(port: int, nbytes: int) -> None:
    """Child side of the raw TCP baseline: receive N bytes, ack; on request, send N bytes."""
    srv = socket.create_server(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.ones(nbytes, dtype=np.uint8).data
    op = bytearray(1)
    while True:
        n = conn.recv_into(op)
        if n == 0:
            return
        if op[0] == ord("u"):
            _recv_exact(conn, buf)
            conn.sendall(b"k")
        else:
            conn.sendall(buf)


class RawTcp:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        port = free_port()
        self.child = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.kv_transfer_bench", "--raw-server", str(port),
             "--raw-bytes", str(nbytes)]
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                self.sock = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = np.ones(nbytes, dtype=np.uint8).data

    def upload(self) -> float:
        t = time.perf_counter()
        self.sock.sendall(b"u")
        self.sock.sendall(self.buf)
        self.sock.recv(1)
        return time.perf_counter() - t

    def download(self) -> float:
        t = time.perf_counter()
        self.sock.sendall(b"d")
        _recv_exact(self.sock, self.buf)
        return time.perf_counter() - t

    def close(self) -> None:
        self.sock.close()
        self.child.wait(10)


def memcpy_seconds(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch pages first
    t = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t


@dataclass(frozen=True)
class DataPath:
    """How a benchmarked client reaches its store: the transport, and the shared arena."""

    name: str
    transport: str
    shm: bool


PATHS = {
    "ucx": DataPath("ucx", "ucx", shm=False),
    "tcp": DataPath("tcp", "tcp", shm=False),
    "shm": DataPath("shm", "tcp", shm=True),
}


class ClientWorker:
    """The client side in its own process (one transport per process, as in a real
    deployment: UCX's progress engine in a process slows an unrelated TCP socket).
    Reads commands on stdin, answers one JSON line each."""

    def __init__(
        self, path: DataPath, redis_url: str, nbytes: int, block_bytes: int, torch_rows: bool
    ):
        self.path = path
        self.redis_url = redis_url
        self.block_bytes = block_bytes
        self.torch_rows = torch_rows
        self.nblocks = nbytes // block_bytes
        self.counter = 0

    async def serve(self) -> None:
        redis = aioredis.from_url(self.redis_url)
        transport = make_transport(self.path.transport)
        client = KVStoreClient(transport, redis, Keys(f"bench-{self.path.name}"), shm=self.path.shm)
        src, dst = self._blocks()
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd, *rest = line.split()
            if cmd == "round":
                put_s, ids = await self._put(client, src)
                get_s = await self._get(client, ids, dst)
                same = all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))
                (node,) = await client.nodes()
                reply: dict[str, Any] = {
                    "put": put_s,
                    "get": get_s,
                    "same": same,
                    "local": node.local,
                }
            elif cmd == "layers":
                put_s, ids = await self._put_layers(client, src)
                for buf in dst:
                    buf[:] = 0
                stream_s = await self._stream(client, ids, dst)
                same = all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))
                reply = {"put_layers": put_s, "stream": stream_s, "same": same}
            elif cmd == "latency":
                _, ids = await self._put(client, src[:1])
                reply = {
                    "us": [await self._get(client, ids, dst[:1]) * 1e6 for _ in range(int(rest[0]))]
                }
            else:
                break
            print(json.dumps(reply), flush=True)
        await client.close()
        await transport.shutdown()
        await redis.aclose()

    def _blocks(self) -> tuple[list[Any], list[Any]]:
        """Blocks to put and blocks to get into: numpy arrays, or a CPU pool's rows."""
        shape = (self.nblocks, self.block_bytes)
        src, dst = np.random.randint(0, 255, shape, dtype=np.uint8), np.empty(shape, np.uint8)
        if not self.torch_rows:
            return list(src), list(dst)
        import torch

        return list(torch.from_numpy(src)), list(torch.from_numpy(dst))

    async def _put(self, client: KVStoreClient, blocks: list[Any]) -> tuple[float, list[str]]:
        self.counter += 1
        ids = [f"{self.counter:016x}{i:016x}" for i in range(len(blocks))]
        t = time.perf_counter()
        await client.put(ids, blocks, num_layers=NUM_LAYERS)
        return time.perf_counter() - t, ids

    async def _get(self, client: KVStoreClient, ids: list[str], into: list[Any]) -> float:
        t = time.perf_counter()
        await client.get(ids, into)
        return time.perf_counter() - t

    async def _put_layers(
        self, client: KVStoreClient, blocks: list[Any]
    ) -> tuple[float, list[str]]:
        """Prefill's pattern: reserve, then one write per layer carrying every block's slice."""
        self.counter += 1
        ids = [f"{self.counter:016x}{i:016x}" for i in range(len(blocks))]
        lb = self.block_bytes // NUM_LAYERS
        t = time.perf_counter()
        handle = await client.begin_put(ids, [self.block_bytes] * len(ids), num_layers=NUM_LAYERS)
        for layer in range(NUM_LAYERS):
            span = (layer, layer + 1)
            await handle.write(ids, [b[layer * lb : (layer + 1) * lb] for b in blocks], span)
        await handle.commit()
        return time.perf_counter() - t, ids

    async def _stream(self, client: KVStoreClient, ids: list[str], into: list[Any]) -> float:
        t = time.perf_counter()
        async for _ in client.stream(ids, into, num_layers=NUM_LAYERS, wait_s=30):
            pass
        return time.perf_counter() - t


class StoreTarget:
    """One store process for a data path and a client worker process driving it."""

    def __init__(
        self,
        path: DataPath,
        redis_url: str,
        workdir: Path,
        nbytes: int,
        capacity_gb: float,
        block_bytes: int,
        torch_rows: bool,
    ):
        self.name = path.name
        http, data = free_ports(2)
        env = {
            "BATON_REDIS_URL": redis_url,
            "BATON_REDIS_PREFIX": f"bench-{path.name}",
            "BATON_TRANSPORT": path.transport,
            "BATON_KVSTORE_HTTP_PORT": str(http),
            "BATON_KVSTORE_DATA_PORT": str(data),
            "BATON_KVSTORE_CAPACITY_GB": str(capacity_gb),
            "BATON_KVSTORE_SHM": str(path.shm).lower(),
            "BATON_LOG_LEVEL": "warning",
        }
        log = workdir / f"kvstore-{path.name}.log"
        self.proc = ServiceProcess("services.kvstore", env, f"http://127.0.0.1:{http}/ready", log)
        self.proc.start().wait_ready()
        self.client = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.kv_transfer_bench", "--client", path.name,
             "--redis-url", redis_url, "--raw-bytes", str(nbytes),
             "--block-bytes", str(block_bytes), *(["--torch-rows"] if torch_rows else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def ask(self, command: str) -> dict[str, Any]:
        assert self.client.stdin is not None and self.client.stdout is not None
        self.client.stdin.write(command + "\n")
        self.client.stdin.flush()
        while line := self.client.stdout.readline():
            if line.startswith("{"):
                reply: dict[str, Any] = json.loads(line)
                return reply
        raise RuntimeError(f"{self.name} client worker died")

    def close(self) -> None:
        if self.client.stdin is not None:
            self.client.stdin.close()
        self.client.wait(30)
        self.proc.stop()


def gpu_copies(mb: int = 256, repeats: int = 10) -> dict[str, Any]:
    """GB/s between the GPU and a shared arena pinned in place, and pageable memory."""
    import torch

    from services.kvstore.arena import Arena

    size = mb << 20
    arena = Arena(4 * size, 32 << 20, shared=True)
    shared = torch.from_numpy(arena.buffer[:size])
    pageable = torch.from_numpy(np.ones(size, np.uint8))
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")

    def gbps(dst: torch.Tensor, src: torch.Tensor) -> float:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return size * repeats / (time.perf_counter() - t) / 1e9

    try:
        return {
            "gpu": torch.cuda.get_device_name(),
            "arena_pinned": arena.pinned,
            "h2d_shared_arena": gbps(dev, shared),
            "h2d_pageable": gbps(dev, pageable),
            "d2h_shared_arena": gbps(shared, dev),
            "d2h_pageable": gbps(pageable, dev),
        }
    finally:
        del shared
        arena.close()


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    nblocks = max(1, (args.mb << 20) // args.block_bytes)
    nbytes = nblocks * args.block_bytes
    workdir = Path(tempfile.mkdtemp(prefix="baton-bench-"))
    redis = RedisProcess().start()
    raw = RawTcp(nbytes)
    targets = [
        StoreTarget(
            PATHS[p],
            redis.url,
            workdir,
            nbytes,
            args.capacity_gb,
            block_bytes=args.block_bytes,
            torch_rows=args.torch_rows,
        )
        for p in args.paths
    ]
    times: dict[str, list[float]] = {"memcpy": [], "raw_tcp_up": [], "raw_tcp_down": []}
    cold: dict[str, float] = {}
    local: dict[str, bool] = {}
    latency: dict[str, dict[str, float]] = {}
    try:
        for target in targets:
            # The first put touches fresh arena pages (page faults on this VM run at
            # 0.15-2 GB/s depending on the neighbours), so report it apart; then fill
            # the arena once so measured puts land in memory the store has used before.
            cold[f"{target.name}_put_cold"] = nbytes / target.ask("round")["put"] / 1e9
            for _ in range(int(args.capacity_gb * (1 << 30) / nbytes) + 1):
                local[target.name] = target.ask("round")["local"]
            for kind in KINDS:
                times[f"{target.name}_{kind}"] = []
        raw.upload(), raw.download()
        for _ in range(args.repeats):
            times["memcpy"].append(memcpy_seconds(nbytes))
            times["raw_tcp_up"].append(raw.upload())
            times["raw_tcp_down"].append(raw.download())
            for target in targets:
                result = {**target.ask("round"), **target.ask("layers")}
                if not result["same"]:
                    raise AssertionError(f"{target.name}: a read returned different bytes")
                for kind in KINDS:
                    times[f"{target.name}_{kind}"].append(result[kind])
        for target in targets:
            samples = sorted(target.ask(f"latency {args.latency_samples}")["us"])
            latency[target.name] = {
                "p50_us": samples[len(samples) // 2],
                "p99_us": samples[max(0, int(len(samples) * 0.99) - 1)],
            }
    finally:
        for target in targets:
            target.close()
        raw.close()
        redis.stop()
    gbps = {k: _median_gbps(nbytes, v) for k, v in times.items()}
    us_per_block = {
        k: statistics.median(v) / nblocks * 1e6
        for k, v in times.items()
        if k.split("_", 1)[-1] in KINDS
    }
    ratios = {}
    for target in targets:
        ratios[f"{target.name}_put_vs_raw_tcp"] = gbps[f"{target.name}_put"] / gbps["raw_tcp_up"]
        ratios[f"{target.name}_get_vs_raw_tcp"] = gbps[f"{target.name}_get"] / gbps["raw_tcp_down"]
        ratios[f"{target.name}_put_vs_memcpy"] = gbps[f"{target.name}_put"] / gbps["memcpy"]
        ratios[f"{target.name}_get_vs_memcpy"] = gbps[f"{target.name}_get"] / gbps["memcpy"]
    socket_paths = [t.name for t in targets if t.name != "shm"]
    if any(t.name == "shm" for t in targets):  # the shared-memory path against the sockets
        for base in socket_paths:
            for kind in KINDS:
                ratios[f"shm_{kind}_vs_{base}"] = gbps[f"shm_{kind}"] / gbps[f"{base}_{kind}"]
    return {
        "cpu": cpu_model(),
        "local_client": local,
        "bytes": nbytes,
        "blocks": nblocks,
        "block_bytes": args.block_bytes,
        "torch_rows": args.torch_rows,
        "repeats": args.repeats,
        "gbps_median": gbps,
        "us_per_block_median": us_per_block,
        "gbps_first_touch": cold,
        "ratios": ratios,
        "single_block_get": latency,
        "gpu_gbps": gpu_copies() if cuda_present() else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--capacity-gb", type=float, default=0.25)
    parser.add_argument("--latency-samples", type=int, default=500)
    parser.add_argument(
        "--block-bytes",
        type=int,
        default=BLOCK_BYTES,
        help="bytes per block, a multiple of 30 (the layers of a layer-wise put)",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--raw-server", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--raw-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--torch-rows", action="store_true", help="blocks as a CPU tensor's rows")
    args = parser.parse_args()
    if args.block_bytes <= 0 or args.block_bytes % NUM_LAYERS:
        parser.error(f"--block-bytes must be a positive multiple of {NUM_LAYERS}")
    if args.raw_server:
        raw_server(args.raw_server, args.raw_bytes)
        return
    if args.client:
        worker = ClientWorker(
            PATHS[args.client], args.redis_url, args.raw_bytes, args.block_bytes, args.torch_rows
        )
        asyncio.run(worker.serve())
        return
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    save_json(args.out, report)


if __name__ == "__main__":
    main()
