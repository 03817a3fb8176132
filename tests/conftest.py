"""Shared fixtures: the real default model (pulled once into the cache) and engines over it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shared.config import (
    AttentionBackend,
    CacheConfig,
    DType,
    EngineConfig,
    PreemptionSetting,
    SchedulerConfig,
    default_cache_dir,
)
from shared.engine.engine import Engine
from shared.engine.kv_connector import KVConnector
from shared.hardware import auto_dtype, cpu_flags, cpu_model
from shared.model.loader import LoadedModel, load_model
from shared.procs import RedisProcess

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name the host at the end of the run (kernels and numerics depend on its ISA), so
    a failure seen only in CI's tail says which machine it came from."""
    flags = cpu_flags()
    have = " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + " ".join(ISA_FLAGS)
    terminalreporter.write_line(f"host: {cpu_model()}, {os.cpu_count()} CPUs; {have}")


# The dtype this host computes natively (bf16 with AVX512-BF16 or AMX, fp32 elsewhere).
# Tests of the engine's logic on the second model family (window layers, swapping,
# the connector) run in it: emulated bf16 runs several times slower than fp32 and
# tells nothing more about that logic (bf16's own numerics are tested on the default
# model, in tests/shared/engine and tests/shared/kernels).
HOST_DTYPE: DType = "bfloat16" if auto_dtype("cpu").dtype == "bfloat16" else "float32"
HOST_DTYPE_BYTES = 2 if HOST_DTYPE == "bfloat16" else 4


@pytest.fixture(autouse=True)
def torch_threads() -> Iterator[None]:
    """Each test starts on the process's torch thread count and leaves it there: an
    engine loop with elastic threads sets it per step and keeps its last setting when
    stopped, and every later in-process engine ran on one thread of two."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


CHAT_FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return Path(os.environ.get("BATON_CACHE_DIR") or default_cache_dir())


@pytest.fixture(scope="session")
def loaded_fp32(cache_dir: Path) -> LoadedModel:
    return load_model(None, cache_dir=cache_dir, dtype="float32", progress=False)


EngineFactory = Callable[..., Engine]


@pytest.fixture(scope="session")
def make_engine(loaded_fp32: LoadedModel) -> EngineFactory:
    """Engines share the loaded fp32 weights; each gets its own KV pool and scheduler."""

    def make(
        *,
        kv_cache_bytes: int = 64 << 20,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        attention: AttentionBackend = "auto",
        long_prefill_token_threshold: int = 0,
        connector: KVConnector | None = None,
        preemption_mode: PreemptionSetting = "auto",
        swap_space_bytes: int = 256 << 20,
    ) -> Engine:
        config = EngineConfig(
            attention=attention,
            cache=CacheConfig(
                kv_cache_bytes=kv_cache_bytes,
                enable_prefix_caching=enable_prefix_caching,
                swap_space_bytes=swap_space_bytes,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                enable_chunked_prefill=enable_chunked_prefill,
                long_prefill_token_threshold=long_prefill_token_threshold,
                preemption_mode=preemption_mode,
            ),
        )
        return Engine(loaded_fp32, replace(config, dtype="float32"), connector)

    return make


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    """A real redis-server process for the whole session (tests use distinct key prefixes)."""
    server = RedisProcess().start()
    yield server
    server.stop()
