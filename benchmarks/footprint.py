"""Memory footprint of a local cluster (`baton up`): RSS, PSS and unique pages per process.

Starts ``baton up`` (extra arguments are passed on; ports are moved to a free
range so it can run beside another cluster), waits for the gateway's
``/ready``, sends a few chat requests so lazily allocated memory is counted,
then reads every process of the launcher's tree: RSS and its anonymous / file
/ shmem parts (``/proc/<pid>/status``), PSS (``smaps_rollup``: shared pages
split between their mappers, including processes outside the cluster), and —
as root — the number of distinct physical pages resident in the whole
cluster (``pagemap``), which counts a page that several processes share once.
Stops the cluster with SIGINT.

    python -m benchmarks.footprint                 # the default cluster
    python -m benchmarks.footprint --kv-cache-gb 1  # any `baton up` option
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

KEYS = ("Rss", "Pss", "RssAnon", "RssFile", "RssShmem")
PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea. " * 20,
    "Explain why the sky is blue in three sentences.",
)


def _children() -> dict[int, int]:
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            parents[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def process_tree(root: int) -> list[int]:
    parents = _children()
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    return sorted(found)


def memory_kb(pid: int) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[-1] == "kB" and parts[0].rstrip(":") == "Pss":
            values["Pss"] = int(parts[1])
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            values["Rss" if key == "VmRSS" else key] = int(rest.split()[0])
    return values


def resident_frames(pid: int) -> np.ndarray:
    """Physical frame numbers of ``pid``'s resident pages (zeros without root)."""
    frames = []
    page = os.sysconf("SC_PAGE_SIZE")
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if "[vsyscall]" in line:
                continue
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            pagemap.seek(lo // page * 8)
            entries = np.frombuffer(pagemap.read((hi - lo) // page * 8), dtype=np.uint64)
            present = (entries >> np.uint64(63)) & np.uint64(1) == 1
            frames.append(entries[present] & np.uint64((1 << 55) - 1))
    return np.concatenate(frames) if frames else np.empty(0, dtype=np.uint64)


def process_name(pid: int) -> str:
    cmd = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    if "-m" in cmd:
        return cmd[cmd.index("-m") + 1]
    return os.path.basename(cmd[0])


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return bytes(r.read())


def chat(base: str, model: str, prompt: str) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 48,
        "temperature": 0,
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return str(json.loads(r.read())["choices"][0]["message"]["content"])


def wait_ready(proc: subprocess.Popen[bytes], base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"baton up exited with {proc.returncode}")
        try:
            _get(base + "/ready")
            return
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    raise SystemExit(f"the cluster was not ready after {timeout_s:.0f} s")


def report(root: int) -> dict[str, object]:
    rows = []
    for pid in process_tree(root):
        try:
            rows.append((process_name(pid), pid, memory_kb(pid)))
        except OSError:  # exited meanwhile
            continue
    print(f"{'process':30s}{'pid':>8s}" + "".join(f"{k + ' MB':>13s}" for k in KEYS))
    totals = dict.fromkeys(KEYS, 0)
    for name, pid, mem in rows:
        print(f"{name[:30]:30s}{pid:8d}" + "".join(f"{mem.get(k, 0) / 1024:13.1f}" for k in KEYS))
        for k in KEYS:
            totals[k] += mem.get(k, 0)
    print(f"{'TOTAL':30s}{'':8s}" + "".join(f"{totals[k] / 1024:13.1f}" for k in KEYS))
    unique_mb = None
    if os.geteuid() == 0:
        frames = np.concatenate([resident_frames(pid) for _, pid, _ in rows])
        unique_mb = len(np.unique(frames)) * os.sysconf("SC_PAGE_SIZE") / 2**20
        print(f"distinct resident pages of the cluster: {unique_mb:.1f} MB")
    return {
        "processes": [{"name": n, "pid": p, **{k: m.get(k, 0) for k in KEYS}} for n, p, m in rows],
        "total_kb": totals,
        "unique_mb": unique_mb,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-port", type=int, default=41000)
    parser.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args, up_args = parser.parse_known_args()
    base_port = args.base_port
    ports = {"--port": 0, "--prefill-port": 100, "--decode-port": 200}
    ports |= {"--kvstore-port": 300, "--redis-port": 400}
    port_args = [a for flag, off in ports.items() for a in (flag, str(base_port + off))]
    baton = shutil.which("baton") or str(Path(sys.executable).with_name("baton"))
    base = f"http://127.0.0.1:{base_port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [baton, "up", *port_args, *up_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_ready(proc, base, 400)
            model = json.loads(_get(base + "/v1/models"))["data"][0]["id"]
            for prompt in PROMPTS:
                print(repr(chat(base, model, prompt)[:60]))
            time.sleep(2)  # a heartbeat or two: what the requests allocated is counted
            result = report(proc.pid)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
