"""Elastic threads: the policy on scripted CPU samples (a fake source), and the
guarantee it rests on, on the real model: a step's results do not depend on the
thread count it ran on."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from shared.config import EngineConfig, SchedulerConfig
from shared.engine.cpu_load import IDLE_LOOK_S, LOAD_WINDOW_S, CpuTimes, RecentLoad, busy_seconds
from shared.engine.elastic_threads import (
    MAX_IDLE_S,
    PRESSED_CHECKS,
    RECHECK_S,
    ProcStatSource,
    ThreadGovernor,
    _OwnThreads,
    sibling_threads,
    threads_for,
)
from shared.engine.engine import Engine
from shared.engine.outputs import Completion, RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import load_model
from tests.shared.engine.fake_cpu import FakeCpuSource


def governor(source: FakeCpuSource, low: int = 1, high: int = 2) -> ThreadGovernor:
    return ThreadGovernor(source, low, high, clock=lambda: source.now)


def recheck(gov: ThreadGovernor, src: FakeCpuSource) -> int:
    """A layer boundary far enough from the last for the governor to look again."""
    src.advance(2 * RECHECK_S)
    return gov.recheck()


def test_threads_for_counts_free_cores_within_bounds() -> None:
    assert threads_for(2, 0, 1, 2) == 2
    assert threads_for(2, 1, 1, 2) == 1
    assert threads_for(2, 3, 1, 2) == 1  # never below the floor
    assert threads_for(8, 0, 1, 4) == 4  # nor above the ceiling
    assert threads_for(8, 3, 2, 8) == 5


def test_the_next_step_starts_where_the_last_ended() -> None:
    src = FakeCpuSource()
    gov = governor(src)
    assert gov.decide() == 2
    src.running = 1  # decode streaming
    assert [recheck(gov, src) for _ in range(PRESSED_CHECKS)][-1] == 1
    src.advance(0.05)  # the next chunk, right after
    assert gov.decide() == 1  # still shared: rechecks grow it if the other role stops
    src.running = 0
    assert [recheck(gov, src) for _ in range(PRESSED_CHECKS)][-1] == 2
    assert gov.changes == 3  # 1 -> 2 (the first step), -> 1, -> 2


def test_after_an_idle_spell_a_step_starts_on_every_core() -> None:
    """A lone prompt arriving: whatever ran as it arrived (the gateway routing it, decode
    taking its half, the client) must not hold it to one core."""
    src = FakeCpuSource()
    gov = governor(src)
    src.running = 1
    gov.decide()
    assert [recheck(gov, src) for _ in range(PRESSED_CHECKS)][-1] == 1
    src.advance(MAX_IDLE_S + 0.1)  # idle: a lone prompt arrives while others still run
    assert gov.decide() == 2
    src.running = 0  # what ran at the arrival is done: the step keeps both cores
    assert [recheck(gov, src) for _ in range(2 * PRESSED_CHECKS)] == [2] * (2 * PRESSED_CHECKS)


def test_a_step_after_waiting_for_work_starts_on_every_core() -> None:
    """Prompts a moment apart (a client sending one after another): the last prompt's
    step shrank while others ran, but the engine then waited for work, so what it saw
    is stale and the next prompt starts on every core however soon it comes."""
    src = FakeCpuSource()
    gov = governor(src)
    gov.decide()
    src.running = 1
    assert [recheck(gov, src) for _ in range(PRESSED_CHECKS)][-1] == 1
    src.advance(0.05)  # far less than MAX_IDLE_S
    assert gov.decide() == 1  # the next chunk of the same work: where the last ended
    assert gov.decide(after_idle=True) == 2


def test_a_step_after_waiting_leaves_the_cores_a_streaming_role_computes_on() -> None:
    """Prompts a moment apart while decode streams (8 in flight): the next prompt starts
    beside decode's engine, not on its core (2 threads on 1 free core stall at every
    barrier until the rechecks shrink them); once decode is idle, every core again."""
    src = FakeCpuSource()
    gov = governor(src)
    src.running = src.siblings = 1
    assert gov.decide(after_idle=True) == 1
    src.running = src.siblings = 0
    assert gov.decide(after_idle=True) == 2
    src.running = 3  # the gateway, decode's event loop and the client, as a prompt arrives
    assert gov.decide(after_idle=True) == 2


def idle(gov: ThreadGovernor, src: FakeCpuSource, seconds: float) -> None:
    """The engine waiting for work for ``seconds``, looking at the machine meanwhile."""
    for _ in range(round(seconds / IDLE_LOOK_S)):
        src.advance(IDLE_LOOK_S)
        gov.observe()


def test_a_step_after_waiting_leaves_the_core_a_busy_process_holds() -> None:
    """A load generator on the same machine (one core's worth, steadily): the next
    prompt starts on the core it leaves, whether or not it runs at that instant (two
    threads beside it stall at every barrier). A light client's share, or a burst
    that ended a moment before the prompt came, does not cost the prompt a core."""
    src = FakeCpuSource()
    gov = governor(src)
    assert gov.decide(after_idle=True) == 2  # nothing seen yet: every core
    src.others_load = 0.95
    idle(gov, src, 1.0)
    assert gov.decide(after_idle=True) == 1  # not running at this instant, yet busy
    src.running = 1  # then seen at the looks between layers: it keeps its core
    assert [recheck(gov, src) for _ in range(2 * PRESSED_CHECKS)] == [1] * (2 * PRESSED_CHECKS)
    src.running, src.others_load = 0, 0.0  # it stopped: the next prompt gets every core
    idle(gov, src, 2 * LOAD_WINDOW_S)
    assert gov.decide(after_idle=True) == 2
    src.others_load = 2.0  # a benchmark's other engine on both cores ...
    idle(gov, src, 0.3)
    src.others_load = 0.2  # ... done a moment ago; a light client and the gateway streaming
    idle(gov, src, LOAD_WINDOW_S + IDLE_LOOK_S)
    src.running = 2  # ... and both running as the prompt arrives
    assert gov.decide(after_idle=True) == 2


def test_a_step_started_beside_a_busy_process_follows_the_looks_after() -> None:
    """Started on the cores a load generator leaves; between layers the looks decide as
    for any step: seen running, it keeps its core; once the looks find the core free
    PRESSED_CHECKS times in a row (it stopped, or it seldom runs), the step grows."""
    src = FakeCpuSource(cpus=4)
    gov = governor(src, 1, 4)
    src.others_load = 1.0
    idle(gov, src, 1.0)
    assert gov.decide(after_idle=True) == 3
    src.running = 1  # seen at the looks
    assert [recheck(gov, src) for _ in range(2 * PRESSED_CHECKS)] == [3] * (2 * PRESSED_CHECKS)
    src.running = 0  # not seen any more
    assert [recheck(gov, src) for _ in range(PRESSED_CHECKS)][-1] == 4


def test_recent_load_is_the_other_processes_share_over_both_of_the_last_two_windows() -> None:
    load = RecentLoad(window_s=0.125, windows=2)  # times in binary fractions: exact arithmetic

    def at(t: float, machine: float, ours: float) -> float:
        load.add(CpuTimes(at=t, machine=machine, ours=ours))
        return load.cores()

    assert load.cores() == 0.0
    assert at(0.0, 0.0, 0.0) == 0.0
    assert at(0.125, 0.1, 0.0) == 0.0  # one window (0.8 cores): not two yet
    assert not load.due(0.13) and load.due(0.140625)
    # 0.125-0.25: 0.225 CPU-seconds busy, 0.125 of them ours and our siblings'
    assert at(0.25, 0.325, 0.125) == pytest.approx(0.8)
    assert load.held_cores() == 1
    # the others stop: the newest window shows it at once
    assert at(0.375, 0.45, 0.25) == pytest.approx(0.0)
    assert load.held_cores() == 0
    # a burst of two cores for one window, then a light 0.25: never held
    assert at(0.5, 0.825, 0.375) == pytest.approx(0.0)  # the older window: 0
    assert at(0.625, 0.98125, 0.5) == pytest.approx(0.25)  # min(2.0 then 0.25)
    assert load.held_cores() == 0
    assert len(load._readings) <= 5  # what no window can start at any more is dropped


def test_busy_seconds_reads_the_engines_cores_from_proc_stat() -> None:
    stat = [
        "cpu  300 0 100 1000 5 0 0 0 0 0",
        "cpu0 100 0 50 500 5 0 0 0 0 0",
        "cpu1 200 7 50 500 0 3 2 9 0 0",
        "intr 12345",
    ]
    hz = os.sysconf("SC_CLK_TCK")
    assert busy_seconds(stat, [1]) == pytest.approx((200 + 7 + 50 + 3 + 2) / hz)
    assert busy_seconds(stat, [0, 1]) == pytest.approx((150 + 262) / hz)
    assert busy_seconds(stat, [5]) == 0.0


def test_between_layers_it_follows_the_other_processes() -> None:
    src = FakeCpuSource()
    gov = governor(src)
    assert gov.decide() == 2  # a long prompt starts on both cores
    src.running = 1  # decode got a stream mid-step
    checks = [recheck(gov, src) for _ in range(PRESSED_CHECKS)]
    assert checks == [2] * (PRESSED_CHECKS - 1) + [1]  # seen PRESSED_CHECKS times in a row
    assert gov.changes == 2
    src.running = 0  # decode idle again: the step grows back as soon
    checks = [recheck(gov, src) for _ in range(PRESSED_CHECKS)]
    assert checks == [1] * (PRESSED_CHECKS - 1) + [2]
    assert gov.changes == 3


def test_a_blip_between_layers_changes_nothing() -> None:
    src = FakeCpuSource()
    gov = governor(src)
    gov.decide()
    for running in [1, 0] * PRESSED_CHECKS + [1] * (PRESSED_CHECKS - 1):
        src.running = running
        assert recheck(gov, src) == 2  # never PRESSED_CHECKS in a row
    src.advance(MAX_IDLE_S + 0.1)
    gov.decide()  # after an idle spell the count starts again
    src.running = 1
    assert recheck(gov, src) == 2


def test_rechecks_read_the_machine_at_most_every_interval() -> None:
    src = FakeCpuSource()
    gov = governor(src)
    gov.decide()
    src.running = 2
    # layers closer together than RECHECK_S: one read, not PRESSED_CHECKS
    assert [gov.recheck() for _ in range(3 * PRESSED_CHECKS)] == [2] * (3 * PRESSED_CHECKS)
    assert [recheck(gov, src) for _ in range(PRESSED_CHECKS)][-1] == 1


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        ThreadGovernor(FakeCpuSource(), 3, 2)
    with pytest.raises(ValueError):
        ThreadGovernor(FakeCpuSource(), 0, 2)


@pytest.mark.skipif(not ProcStatSource.available(), reason="no /proc/stat")
def test_sibling_engine_threads_are_found_by_name_and_read_running() -> None:
    """Two processes started side by side by one parent (as ``baton up`` starts the roles):
    the one computing on a thread named like the engine thread is seen running from
    the other; a thread of another name, or one asleep, is not."""
    name = "baton-test-eng"

    def child(engine_busy: bool, other_busy: bool) -> str:
        """A process with a thread called ``name`` and one called otherwise, each
        spinning or asleep (one spinning thread each: the GIL would park a second)."""
        return (
            "import ctypes, threading, time\n"
            "def work(name, busy):\n"
            "    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)\n"
            "    while True:\n"
            "        if not busy: time.sleep(1)\n"
            f"threading.Thread(target=work, args=({name!r}, {engine_busy}), daemon=True).start()\n"
            f"threading.Thread(target=work, args=('other', {other_busy}), daemon=True).start()\n"
            "time.sleep(60)\n"
        )

    codes = [child(engine_busy=True, other_busy=False), child(engine_busy=False, other_busy=True)]
    procs = [subprocess.Popen([sys.executable, "-c", code]) for code in codes]
    try:
        deadline = time.monotonic() + 30
        while len(paths := sibling_threads(name, parent=os.getpid())) < 2:
            assert time.monotonic() < deadline, paths
            time.sleep(0.05)
        busy = ProcStatSource(engine_thread=name, parent=os.getpid())  # the children's view
        # the spinning engine thread is running or runnable at every look (another
        # thread spinning, or an engine thread asleep, is not counted)
        assert {busy.busy_siblings() for _ in range(20)} == {1}
        procs[0].kill()
        procs[0].wait()
        assert busy.busy_siblings() == 0  # an ended thread reads as not running
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.skipif(not ProcStatSource.available(), reason="no /proc/stat")
def test_proc_stat_source_reads_this_machine() -> None:
    src = ProcStatSource()
    assert src.cpus >= 1 and src.running_others() >= 0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _wait_until_spinning(pid: int, timeout_s: float = 30.0) -> None:
    """Until the child has run its interpreter's start-up and spun a while (its own CPU
    time, not a fixed sleep: a loaded machine starts it late)."""
    deadline = time.monotonic() + timeout_s
    start = None
    while time.monotonic() < deadline:
        used = _cpu_seconds(pid)
        if start is None and used >= 0.05:
            start = used
        if start is not None and used - start >= 0.1:
            return
        time.sleep(0.01)
    raise AssertionError(f"the spinning child {pid} did not spin within {timeout_s} s")


@pytest.mark.skipif(not ProcStatSource.available(), reason="no /proc/stat")
def test_a_process_spinning_beside_this_one_is_seen_as_a_held_core() -> None:
    """The real machine: a child spinning on one of this process's cores for a second
    is read as about one core of other processes' sustained load; this process's own
    spinning is not."""
    cpu = min(os.sched_getaffinity(0))
    src = ProcStatSource(cpus=frozenset({cpu}))
    load = RecentLoad(window_s=0.3, windows=1)
    load.add(src.cpu_times())
    end = time.monotonic() + 0.4
    while time.monotonic() < end:  # this process spinning: its own time
        pass
    load.add(src.cpu_times())
    assert load.held_cores() == 0, load.cores()
    spin = (
        f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\n"
        "end = time.time() + 30\nwhile time.time() < end: pass\n"
    )
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        _wait_until_spinning(child.pid)
        load.add(src.cpu_times())
        time.sleep(0.4)
        load.add(src.cpu_times())
        assert load.held_cores() == 1, load.cores()
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not ProcStatSource.available(), reason="no /proc/stat")
def test_own_threads_are_read_from_files_opened_once_and_follow_starts_and_ends() -> None:
    """The reader keeps each thread's stat file open between looks: a thread started
    since the last look is read (never taken for another process's), one that ended is
    dropped and its file closed; a thread asleep is not running, the reader is."""
    own = _OwnThreads()
    stop = threading.Event()
    started = [threading.Thread(target=stop.wait) for _ in range(4)]
    for t in started:
        t.start()
    assert own.running() >= 1  # the reader itself
    tids = {str(t.native_id) for t in started}
    assert tids <= own._fds.keys()
    files = {own._fds[tid]: os.fstat(own._fds[tid]).st_ino for tid in tids}
    stop.set()
    for t in started:
        t.join()
    # a joined thread may still be listed while the kernel finishes its exit
    deadline = time.monotonic() + 5
    while True:
        own.running()
        if not tids & own._fds.keys() or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not tids & own._fds.keys()
    for fd, inode in files.items():  # closed, or the number reused for another file
        with contextlib.suppress(OSError):
            assert os.fstat(fd).st_ino != inode


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_switching_threads_between_steps_changes_no_result(cache_dir: Path, dtype: str) -> None:
    """A batch of prompts (prefill chunks and decode steps) run on 1 thread, and again
    with the thread count switched 2, 1, 2, ... between steps: identical tokens and
    bitwise identical logprobs."""
    loaded = load_model(None, cache_dir=cache_dir, dtype=dtype, progress=False)
    config = EngineConfig(  # 64-token steps: the long prompt is chunked over several
        dtype=dtype,  # type: ignore[arg-type]
        num_threads=1,
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )
    texts = ["The quick brown fox", "Python is a programming language. " * 30, "Hi"]
    prompts = [loaded.tokenizer.encode(t) for t in texts]
    params = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
    ]
    saved = torch.get_num_threads()
    try:
        fixed = Engine(loaded, config).generate(prompts, params)
        elastic = Engine(loaded, config)
        step, counts = elastic.step, iter(range(10_000))

        def switching_step(*, defer_copies: bool = False) -> list[RequestOutput]:
            elastic.set_num_threads(2 - next(counts) % 2)
            return step(defer_copies=defer_copies)

        elastic.step = switching_step  # type: ignore[method-assign]
        switched = elastic.generate(prompts, params)
    finally:
        torch.set_num_threads(saved)
    _assert_identical(switched, fixed)


def _assert_identical(got: list[Completion], want: list[Completion]) -> None:
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want, strict=True):
        assert [lp.logprob for lp in g.logprobs] == [lp.logprob for lp in w.logprobs]
        assert [lp.top for lp in g.logprobs] == [lp.top for lp in w.logprobs]
