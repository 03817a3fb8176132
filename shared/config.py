"""One typed configuration tree.

Inside the process everything is a frozen dataclass; the service edge reads
environment variables (prefix ``BATON_``) with pydantic-settings and converts
them with :meth:`BatonSettings.engine_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.errors import ConfigError
from shared.hardware import auto_dtype

DType = Literal["float32", "bfloat16", "float16"]
# auto: bfloat16 where the hardware computes it natively, else float32 (shared.hardware)
DTypeSetting = Literal["auto", "float32", "bfloat16", "float16"]
# attention: the native C kernels (CPU), the Triton kernel (CUDA), pure torch, or the
# first of native / Triton that runs here
AttentionBackend = Literal["auto", "native", "triton", "torch"]
# weight GEMMs: the native fp32 kernel (CPU), oneDNN on prepacked weights (CPU), the
# batch-invariant Triton GEMM (CUDA), F.linear, or the best of these that runs here
LinearBackend = Literal["auto", "native", "onednn", "triton", "torch"]
# RMSNorm, RoPE, SwiGLU's activation: native C kernels (CPU), Triton RMSNorm with torch
# for the rest (CUDA), torch, or the first of native / Triton that runs here
PointwiseBackend = Literal["auto", "native", "triton", "torch"]
# the KV pool on 2 MB pages the host reserved: when free (auto), required (on), never (off)
HugePages = Literal["auto", "on", "off"]

DEFAULT_BLOCK_SIZE = 16
# Each prefill/decode process's KV pool, touched up front (see CacheConfig.prefault):
# 0.5 GiB holds ~11,600 tokens of the default model in fp32 (46,080 B/token; twice
# that in bf16): a whole 8,192-token context plus headroom, on a laptop. Raise it
# (BATON_KV_CACHE_GB, `baton up --kv-cache-gb`) for many long requests at once.
DEFAULT_KV_CACHE_GB = 0.5
DEFAULT_SWAP_SPACE_GB = 1.0
# preemption: swap or recompute by the measured cost model (auto), swap whenever host
# space allows, or always recompute
PreemptionSetting = Literal["auto", "swap", "recompute"]


def resolve_dtype(setting: DTypeSetting, device: str) -> DType:
    """The compute dtype: the setting, or for ``auto`` what the hardware runs natively."""
    if setting != "auto":
        return setting
    return "bfloat16" if auto_dtype(device).dtype == "bfloat16" else "float32"


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens each."""

    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_bytes: int = int(DEFAULT_KV_CACHE_GB * (1 << 30))
    enable_prefix_caching: bool = True
    # touch every page of the pool at start-up: a first touch costs a page fault
    # (0.2-0.5 GB/s on this VM), which would otherwise stall a step or a transfer
    prefault: bool = False
    huge_pages: HugePages = "auto"
    # host memory preempted requests' KV is swapped to (0: none; a preempted request
    # spills to the KV store, where the connector keeps it, or else recomputes);
    # untouched until used
    swap_space_bytes: int = int(DEFAULT_SWAP_SPACE_GB * (1 << 30))
    # sliding-window layers keep only their window's KV (shared.kv.layer_groups; CPU
    # pools); False: every layer keeps every block, as in a model without windows
    sliding_window_kv: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits of one engine step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    # cap on one request's prompt chunk per step (0: none, the budget is the cap)
    long_prefill_token_threshold: int = 0
    preemption_mode: PreemptionSetting = "auto"
    # one prompt per step, the one with the fewest tokens left (a prefill instance's
    # policy: prompts sharing steps all get their first token when the last ends)
    shortest_prompt_first: bool = False


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # path to a GGUF file or HF folder; None = embedded default
    dtype: DType = "float32"
    device: str = "cpu"
    num_threads: int | None = None
    attention: AttentionBackend = "auto"
    linear: LinearBackend = "auto"
    pointwise: PointwiseBackend = "auto"
    kernel_dir: Path = field(default_factory=lambda: default_cache_dir() / "kernels")
    # CUDA: replay decode steps from CUDA graphs (shared.engine.cuda_graphs)
    cuda_graphs: bool = True
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()


@dataclass(frozen=True)
class SloConfig:
    """The cluster's latency targets, in seconds (None: no target on that measure). A
    request meets them when its time to first token and its time per output token
    (after the first; a one-token output has none) are each within their target."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def is_set(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None


@dataclass(frozen=True)
class ClusterConfig:
    """Where the cluster's shared state lives and how data moves between nodes."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "baton"
    transport: str = "ucx"
    replication: int = 1
    heartbeat_s: float = 1.0
    member_ttl_s: float = 5.0
    index_ttl_s: float = 3600.0
    # presented by every internal HTTP call and data-plane connection (None: open)
    secret: str | None = field(default=None, repr=False)


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "baton"


class BatonSettings(BaseSettings):
    """Environment-facing settings (``BATON_MODEL``, ``BATON_DTYPE``, ...)."""

    model_config = SettingsConfigDict(env_prefix="BATON_", extra="ignore")

    model: str | None = None
    dtype: DTypeSetting = "auto"
    device: str = "cpu"
    num_threads: int | None = Field(default=None, ge=1)
    # services: grow each step's threads up to this many while other processes leave
    # cores idle, back to num_threads (or 1) when they need them (None: fixed)
    max_threads: int | None = Field(default=None, ge=1)
    attention: AttentionBackend = "auto"
    linear: LinearBackend = "auto"
    pointwise: PointwiseBackend = "auto"
    cuda_graphs: bool = True
    cache_dir: Path = Field(default_factory=default_cache_dir)
    block_size: int = Field(default=DEFAULT_BLOCK_SIZE, ge=1, le=1024)
    kv_cache_gb: float = Field(default=DEFAULT_KV_CACHE_GB, gt=0)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    preemption_mode: PreemptionSetting = "auto"
    swap_space_gb: float = Field(default=DEFAULT_SWAP_SPACE_GB, ge=0)
    prefault_kv: bool = True  # services; `baton generate` (one shot) skips it
    kv_huge_pages: HugePages = "auto"
    sliding_window_kv: bool = True
    # services: CPUs for the engine thread alone (BATON_CPUS pins the whole process), so
    # HTTP and KV transfers can run on other cores than the model, e.g. "1"
    engine_cpus: str | None = Field(default=None, pattern=r"^\d+(,\d+)*$")
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = Field(default="baton", pattern=r"^[A-Za-z0-9_.-]+$")
    transport: Literal["ucx", "tcp"] = "ucx"
    replication: int = Field(default=1, ge=1, le=8)
    heartbeat_s: float = Field(default=1.0, gt=0)
    member_ttl_s: float = Field(default=5.0, gt=0)
    index_ttl_s: float = Field(default=3600.0, gt=0)
    # the cluster secret internal surfaces demand (`baton up` generates one), or a file
    # holding it (compose: the volume its one-shot `secret` service writes)
    cluster_secret: str | None = Field(default=None, min_length=16, repr=False)
    cluster_secret_file: Path | None = None
    # latency targets, seconds (`baton up --slo-ttft/--slo-tpot`): every process reads them
    slo_ttft: float | None = Field(default=None, gt=0)
    slo_tpot: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _secret_from_file(self) -> BatonSettings:
        """The secret given directly wins; else the file's (whitespace around it dropped)."""
        path = self.cluster_secret_file
        if self.cluster_secret is not None or path is None:
            return self
        try:
            secret = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from exc
        if len(secret) < 16:
            raise ValueError(f"{path} holds fewer than 16 characters")
        self.cluster_secret = secret
        return self

    def engine_cpu_set(self) -> frozenset[int] | None:
        if self.engine_cpus is None:
            return None
        return frozenset(int(c) for c in self.engine_cpus.split(","))

    def cluster_config(self) -> ClusterConfig:
        if self.member_ttl_s <= self.heartbeat_s:
            raise ConfigError("BATON_MEMBER_TTL_S must be longer than BATON_HEARTBEAT_S")
        return ClusterConfig(
            redis_url=self.redis_url,
            redis_prefix=self.redis_prefix,
            transport=self.transport,
            replication=self.replication,
            heartbeat_s=self.heartbeat_s,
            member_ttl_s=self.member_ttl_s,
            index_ttl_s=self.index_ttl_s,
            secret=self.cluster_secret,
        )

    def slo(self) -> SloConfig:
        return SloConfig(ttft_s=self.slo_ttft, tpot_s=self.slo_tpot)

    def resolved_dtype(self) -> DType:
        return resolve_dtype(self.dtype, self.device)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            dtype=self.resolved_dtype(),
            device=self.device,
            num_threads=self.num_threads,
            attention=self.attention,
            linear=self.linear,
            pointwise=self.pointwise,
            cuda_graphs=self.cuda_graphs,
            kernel_dir=self.cache_dir / "kernels",
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_bytes=int(self.kv_cache_gb * (1 << 30)),
                enable_prefix_caching=self.enable_prefix_caching,
                prefault=self.prefault_kv,
                huge_pages=self.kv_huge_pages,
                swap_space_bytes=int(self.swap_space_gb * (1 << 30)),
                sliding_window_kv=self.sliding_window_kv,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                preemption_mode=self.preemption_mode,
            ),
        )
