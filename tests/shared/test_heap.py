"""The engine process's heap keeps a step's freed temporaries for the next step."""

from __future__ import annotations

import platform

import pytest

from shared.heap import keep_freed_memory, release_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_takes_every_setting() -> None:
    assert keep_freed_memory()
    assert keep_freed_memory()  # idempotent: a second engine in the process
    release_freed_memory()  # an explicit trim still works after it
