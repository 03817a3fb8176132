"""The Triton attention kernel's logic on the CPU, through Triton's interpreter (in a
child process: the interpreter must be on before Triton is imported, and nothing else
in this process should run interpreted). Needs Triton installed, not CUDA; skipped
without it. The same kernel runs compiled on a GPU in ``test_triton_kernels.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds)")


def test_attention_with_and_without_a_window_is_right_in_every_tiling() -> None:
    module = "tests.shared.kernels.interpreted_attention"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
