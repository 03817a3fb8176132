"""What the ctypes bindings of the C kernels share: loading a library, checking
the layout a kernel assumes before handing it raw pointers, and reading its
return code."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shared.errors import KernelBuildError

# return codes of every kernel entry point
OK, BAD_ARGUMENTS, NO_MEMORY = 0, 1, 2

Problems = list[tuple[bool, str]]


def load_library(path: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"cannot load kernel library {path}: {e}") from e


def bind_dtypes(
    lib: ctypes.CDLL, prefix: str, argtypes: Sequence[type[Any]]
) -> dict[torch.dtype, Any]:
    """The library's ``{prefix}_f32`` and ``{prefix}_bf16`` entry points, typed,
    keyed by the storage dtype each one takes."""
    entries = {}
    for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        fn = getattr(lib, f"{prefix}_{suffix}")
        fn.argtypes = list(argtypes)
        fn.restype = ctypes.c_int
        entries[dtype] = fn
    return entries


def pool_problems(k_pool: torch.Tensor, v_pool: torch.Tensor) -> Problems:
    """One layer's K/V pools, ``[blocks, block_size, kv_heads, head_dim]``: each
    block dense inside, both pools alike (blocks themselves may be strided)."""
    _, _, kv_heads, head_dim = k_pool.shape
    inner = (kv_heads * head_dim, head_dim, 1)
    return [
        (k_pool.device.type != "cpu" or v_pool.device.type != "cpu", "pools must be on the CPU"),
        (k_pool.stride()[1:] != inner or v_pool.stride()[1:] != inner, "pool inner layout"),
        (k_pool.stride(0) != v_pool.stride(0) or v_pool.shape != k_pool.shape, "K/V pools differ"),
    ]


def refuse(what: str, problems: Problems) -> None:
    """Raise ``ValueError`` naming every failed check; the kernel trusts raw pointers."""
    bad = [name for failed, name in problems if failed]
    if bad:
        raise ValueError(f"{what}: bad arguments: {', '.join(bad)}")


def check_return(what: str, rc: int) -> None:
    if rc == NO_MEMORY:
        raise MemoryError(f"{what} could not allocate its scratch memory")
    if rc != OK:
        raise ValueError(f"{what} rejected its arguments (code {rc})")
