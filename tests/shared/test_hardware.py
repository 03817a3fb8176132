"""``--dtype auto``: bfloat16 only where the CPU computes it natively."""

from __future__ import annotations

from pathlib import Path

from shared.config import BatonSettings
from shared.hardware import auto_dtype, cpu_flags, cpu_model


def test_auto_picks_bf16_only_with_native_dot_products() -> None:
    assert auto_dtype("cpu", frozenset({"avx512f", "avx512_bf16"})).dtype == "bfloat16"
    assert auto_dtype("cpu", frozenset({"amx_bf16", "amx_tile"})).dtype == "bfloat16"
    plain = auto_dtype("cpu", frozenset({"avx2", "avx512f"}))
    assert plain.dtype == "float32" and "no native bfloat16" in plain.reason


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "sse", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_the_model_name_is_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n")
    assert cpu_model(info) == "AMD EPYC 9R14 96-Core Processor"
    assert cpu_model(tmp_path / "missing")  # some name, never an error


def test_settings_resolve_auto_and_keep_an_explicit_dtype() -> None:
    assert BatonSettings().dtype == "auto"
    assert BatonSettings().engine_config().dtype == auto_dtype("cpu").dtype
    assert BatonSettings(dtype="float32").engine_config().dtype == "float32"
