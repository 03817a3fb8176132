"""The gateway is a tokenizer and an HTTP server: importing it must not load torch or numpy
(each gateway process would carry ~150 MB of tensor runtime it never uses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "numpy", "gguf", "safetensors")


@pytest.mark.parametrize(
    "module",
    ["services.gateway.app", "services.gateway.__main__", "shared.model.tokenizer_loader"],
)
def test_gateway_imports_no_tensor_runtime(module: str) -> None:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_tokenizer_only_loads_without_torch(cache_dir: Path) -> None:
    """Loading the default model's tokenizer (what the gateway does at start-up)
    reads the converted folder and still imports no torch."""
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from shared.model.tokenizer_loader import load_tokenizer\n"
        f"m = load_tokenizer(None, cache_dir=Path({str(cache_dir)!r}))\n"
        "ids = m.tokenizer.encode_chat([{'role': 'user', 'content': 'hi'}])\n"
        "print(json.dumps([m.arch.num_layers, len(ids) > 0, 'torch' in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    layers, encoded, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert layers > 0 and encoded
    assert not torch_loaded
