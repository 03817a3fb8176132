"""Packed weights in one file that every engine process on the host maps.

Prefill and decode on one machine load the same model in the same dtype with
the same GEMM backend, so their packed weights are byte-identical. Packing
once, writing the result under ``<cache>/packed/`` and mapping that file
(private, copy-on-write, never written) lets the processes share one copy in
the page cache instead of each holding its own (≈ 540 MB for the default
model in fp32); a later start maps the file instead of repacking.

Layout: 8-byte magic, 8-byte little-endian header length, a JSON header (each
tensor's name, dtype, shape, byte offset and, for packed GEMM weights, the
logical ``[out, in]``), then the tensors, each at a 4 KiB-aligned offset.
The file is written to a temporary name and renamed into place under a lock,
so a reader never sees a partial file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shared.filelock import file_lock
from shared.heap import release_freed_memory
from shared.kv.layout import dtype_name, torch_dtype
from shared.model.decoder import LayerWeights, ModelWeights
from shared.model.linear import PackedWeight

log = logging.getLogger(__name__)

MAGIC = b"BATONPW\x01"
FORMAT_VERSION = 1
ALIGN = 4096
# Linux's value (5.14+); Python 3.11's mmap module lacks the name
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def packing_code(*parts: Callable[..., Any]) -> str:
    """A digest of the source files that define ``parts`` (the packing function, the
    backend's class): an edit to how weights are packed names another file, so a
    checkout never maps weights another checkout packed differently."""
    h = hashlib.sha256()
    for path in sorted({inspect.getsourcefile(p) or "" for p in parts}):
        h.update(Path(path).read_bytes() if path else b"")
    return h.hexdigest()[:16]


def packed_path(
    packed_dir: Path,
    name: str,
    identity: str,
    folder: Path,
    dtype: str,
    backend: str,
    tag: str,
    code: str,
) -> Path:
    """Where the weights of the model in ``folder``, packed in ``dtype`` by ``backend``
    (its layout named by ``tag``, by the code :func:`packing_code` digests), are kept.
    Any change to the weight files, the layout or that code gives another path; the
    name starts with what :func:`load_or_pack` uses to remove the files it replaces."""
    h = hashlib.sha256(json.dumps([FORMAT_VERSION, identity, dtype, tag, code]).encode())
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return packed_dir / f"{name}-{dtype}-{backend}-{h.hexdigest()[:16]}.bin"


def load_or_pack(path: Path, pack: Callable[[], ModelWeights]) -> ModelWeights:
    """The weights mapped from ``path``; when it does not exist yet, ``pack()`` them and
    write the file first (one process packs, concurrent ones wait and map its file).
    Where the file cannot be written the packed weights stay private to this process."""
    mapped = _try_map(path)
    if mapped is not None:
        return mapped
    private: ModelWeights | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path.with_name(path.name + ".lock")):
            mapped = _try_map(path)  # another process may have written it meanwhile
            if mapped is not None:
                return mapped
            private = pack()
            _write(private, path)
    except OSError as e:
        log.warning(
            "packed weights stay private to this process (%s cannot be written: %s)", path, e
        )
        return private if private is not None else pack()
    with contextlib.suppress(OSError):
        _remove_replaced(path)
    mapped = _try_map(path)
    if mapped is None:  # written, yet unreadable: keep serving from the private copy
        return private
    del private  # from here on the mapped file serves
    release_freed_memory()
    return mapped


def _remove_replaced(path: Path) -> None:
    """Delete older files of the same model, dtype and backend (an edited kernel or
    model leaves one behind, hundreds of MB each). A process that still maps one
    keeps its pages until it exits."""
    stem = path.name.rsplit("-", 1)[0] + "-"
    for old in path.parent.iterdir():
        name = old.name
        if name != path.name and name.startswith(stem) and len(name) == len(path.name):
            old.unlink(missing_ok=True)
            old.with_name(name + ".lock").unlink(missing_ok=True)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _flatten(w: ModelWeights) -> dict[str, torch.Tensor | PackedWeight]:
    flat: dict[str, torch.Tensor | PackedWeight] = {
        "final_norm": w.final_norm,
        "lm_head": w.lm_head,
    }
    if w.embed is not None:
        flat["embed"] = w.embed
    for i, layer in enumerate(w.layers):
        for f in dataclasses.fields(layer):
            value = getattr(layer, f.name)
            if value is not None:  # a family's optional tensors (Gemma's extra norms)
                flat[f"layers.{i}.{f.name}"] = value
    return flat


def _unflatten(flat: dict[str, Any], num_layers: int) -> ModelWeights:
    names = [f.name for f in dataclasses.fields(LayerWeights)]

    def layer(i: int) -> LayerWeights:
        # a family's optional tensors are absent from the file where it has none
        fields: dict[str, Any] = {n: flat[k] for n in names if (k := f"layers.{i}.{n}") in flat}
        return LayerWeights(**fields)

    layers = tuple(layer(i) for i in range(num_layers))
    return ModelWeights(
        embed=flat.get("embed"),
        final_norm=flat["final_norm"],
        lm_head=flat["lm_head"],
        layers=layers,
    )


def _write(w: ModelWeights, path: Path) -> None:
    entries: list[dict[str, Any]] = []
    tensors: list[torch.Tensor] = []
    offset = 0
    for name, item in _flatten(w).items():
        t = (item.data if isinstance(item, PackedWeight) else item).contiguous()
        if t.device.type != "cpu":
            raise OSError(f"only CPU weights are written to a file, not {t.device}")
        entry: dict[str, Any] = {
            "name": name,
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "offset": offset,
        }
        if isinstance(item, PackedWeight):
            entry["gemm"] = [item.out_features, item.in_features, item.glu]
        entries.append(entry)
        tensors.append(t)
        offset = _align(offset + t.numel() * t.element_size())
    header = json.dumps(
        {"version": FORMAT_VERSION, "num_layers": len(w.layers), "tensors": entries}
    ).encode()
    data_start = _align(len(MAGIC) + 8 + len(header))
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(MAGIC + len(header).to_bytes(8, "little") + header)
            for entry, t in zip(entries, tensors, strict=True):
                fh.seek(data_start + entry["offset"])
                fh.write(t.reshape(-1).view(torch.uint8).numpy().data)
            fh.truncate(data_start + offset)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _try_map(path: Path) -> ModelWeights | None:
    """The weights in ``path`` as views of one private mapping of it; None when
    there is no such file or it is unreadable (then it is packed again)."""
    try:
        return _map(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        log.warning("ignoring unreadable packed weights %s: %s", path, e)
        return None


def _map(path: Path) -> ModelWeights:
    with open(path, "rb") as fh:
        head = fh.read(len(MAGIC) + 8)
        if len(head) != len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
            raise ValueError("not a packed weights file")
        header = json.loads(fh.read(int.from_bytes(head[len(MAGIC) :], "little")))
        if header.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {header.get('version')}, expected {FORMAT_VERSION}")
        size = os.fstat(fh.fileno()).st_size
        # private and writable, so torch gets an ordinary tensor; nothing writes to
        # weights, so every page stays the page cache's one copy, shared by all mappers
        mapping = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
    _populate(mapping)
    data = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping alive
    start = _align(len(head) + int.from_bytes(head[len(MAGIC) :], "little"))
    flat: dict[str, Any] = {}
    for e in header["tensors"]:
        dtype = torch_dtype(e["dtype"])
        shape = tuple(e["shape"])
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        begin = start + e["offset"]
        if begin + nbytes > size:
            raise ValueError(f"tensor {e['name']} runs past the end of the file")
        t = data[begin : begin + nbytes].view(dtype).view(shape)
        flat[e["name"]] = PackedWeight(t, *e["gemm"]) if "gemm" in e else t
    return _unflatten(flat, int(header["num_layers"]))


def _populate(mapping: mmap.mmap) -> None:
    """Map every page now (read faults only: no copy is made), so the first forward
    does not take a fault per page."""
    try:
        mapping.madvise(MADV_POPULATE_READ)
    except OSError:  # kernels before 5.14: read one byte of every page
        pages = torch.frombuffer(mapping, dtype=torch.uint8)[:: mmap.PAGESIZE]
        pages.sum()
