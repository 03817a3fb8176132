from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from shared.config import BatonSettings


def test_env_settings_build_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_MODEL", "/models/x.gguf")
    monkeypatch.setenv("BATON_DTYPE", "bfloat16")
    monkeypatch.setenv("BATON_KV_CACHE_GB", "0.5")
    monkeypatch.setenv("BATON_MAX_NUM_BATCHED_TOKENS", "512")
    monkeypatch.setenv("BATON_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("BATON_ATTENTION", "torch")
    monkeypatch.setenv("BATON_LINEAR", "onednn")
    monkeypatch.setenv("BATON_POINTWISE", "torch")
    monkeypatch.setenv("BATON_KV_HUGE_PAGES", "off")
    monkeypatch.setenv("BATON_CACHE_DIR", "/data/baton")
    monkeypatch.setenv("BATON_ENGINE_CPUS", "1,3")
    assert BatonSettings().engine_cpu_set() == {1, 3}
    cfg = BatonSettings().engine_config()
    assert cfg.attention == "torch" and str(cfg.kernel_dir) == "/data/baton/kernels"
    assert cfg.linear == "onednn" and cfg.pointwise == "torch"
    assert cfg.cache.huge_pages == "off"
    assert cfg.model == "/models/x.gguf" and cfg.dtype == "bfloat16"
    assert cfg.cache.kv_cache_bytes == 1 << 29 and not cfg.cache.enable_prefix_caching
    assert cfg.scheduler.max_num_batched_tokens == 512


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("BATON_DTYPE", "int8"),
        ("BATON_BLOCK_SIZE", "0"),
        ("BATON_KV_CACHE_GB", "-1"),
        ("BATON_NUM_THREADS", "0"),
        ("BATON_ATTENTION", "flash"),
        ("BATON_LINEAR", "mkl"),
        ("BATON_POINTWISE", "cuda"),
        ("BATON_KV_HUGE_PAGES", "yes"),
        ("BATON_ENGINE_CPUS", "1-3"),
    ],
)
def test_bad_settings_are_rejected(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError):
        BatonSettings()


def test_the_cluster_secret_comes_from_its_file_unless_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Compose's roles read BATON_CLUSTER_SECRET_FILE (the volume its secret service
    writes); a secret given directly wins; an unreadable or short file is refused."""
    path = tmp_path / "cluster-secret"
    path.write_text("s3cret-" + "x" * 20 + "\n")
    monkeypatch.setenv("BATON_CLUSTER_SECRET_FILE", str(path))
    assert BatonSettings().cluster_secret == "s3cret-" + "x" * 20
    assert BatonSettings().cluster_config().secret == "s3cret-" + "x" * 20
    monkeypatch.setenv("BATON_CLUSTER_SECRET", "given-" + "y" * 20)
    assert BatonSettings().cluster_secret == "given-" + "y" * 20
    monkeypatch.delenv("BATON_CLUSTER_SECRET")
    path.write_text("short")
    with pytest.raises(ValidationError, match="fewer than 16"):
        BatonSettings()
    monkeypatch.setenv("BATON_CLUSTER_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValidationError, match="cannot read"):
        BatonSettings()
