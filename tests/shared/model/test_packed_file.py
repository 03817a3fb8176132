"""Packed weights shared through one mapped file, and the tied embedding read from the head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from safetensors import safe_open

from shared.config import EngineConfig
from shared.model.linear import select_linear
from shared.model.loader import LoadedModel, load_resolved
from shared.model.packed_file import packed_path, packing_code
from shared.model.registry import ResolvedModel, resolve
from tests.shared.model.forward import prefill_logits
from tests.shared.model.tiny_gguf import hf_weights, write_tiny_gguf

KERNELS = EngineConfig().kernel_dir
PROMPT = [1, 2, 3, 4, 5, 40, 41, 42, 200, 201, 202, 203, 100, 7, 8, 9, 10, 11]


def needs_a_packed_file(dtype: str) -> None:
    """Skip where the GEMM the loader picks for ``dtype`` keeps no packed form to share
    (oneDNN and torch pack in memory: where the native kernel does not build for the dtype)."""
    gemm = select_linear("auto", getattr(torch, dtype), "cpu", KERNELS)
    if gemm.cache_tag() is None:
        pytest.skip(f"the {gemm.name} linear backend writes no packed file")


@pytest.fixture
def tiny(tmp_path: Path) -> ResolvedModel:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, hf_weights(), GGMLQuantizationType.F32)
    return resolve(str(path), tmp_path / "cache", progress=False)


def load(resolved: ResolvedModel, dtype: str, packed_dir: Path | None) -> LoadedModel:
    return load_resolved(
        resolved, dtype=dtype, device="cpu", kernel_dir=KERNELS, packed_dir=packed_dir
    )


def mapped_from(t: torch.Tensor, path: Path) -> bool:
    """Whether ``t``'s memory lies in a mapping of the file ``path``."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == str(path):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weights_are_written_once_then_mapped(
    tiny: ResolvedModel, tmp_path: Path, dtype: str
) -> None:
    needs_a_packed_file(dtype)
    packed = tmp_path / "packed"
    private = load(tiny, dtype, None)
    first = load(tiny, dtype, packed)
    (file,) = packed.glob("*.bin")
    stamp = file.stat().st_mtime_ns
    second = load(tiny, dtype, packed)
    assert file.stat().st_mtime_ns == stamp  # mapped, not packed again
    for loaded in (first, second):
        assert mapped_from(loaded.model.lm_head.data, file)
        assert mapped_from(loaded.model.layers[-1].down.data, file)
    want = prefill_logits(private, PROMPT)
    assert torch.equal(prefill_logits(first, PROMPT), want)
    assert torch.equal(prefill_logits(second, PROMPT), want)


def test_unreadable_packed_file_is_packed_again(tiny: ResolvedModel, tmp_path: Path) -> None:
    needs_a_packed_file("float32")
    packed = tmp_path / "packed"
    want = prefill_logits(load(tiny, "float32", packed), PROMPT)
    (file,) = packed.glob("*.bin")
    file.write_bytes(b"not a weights file")
    again = load(tiny, "float32", packed)
    assert mapped_from(again.model.lm_head.data, file)
    assert torch.equal(prefill_logits(again, PROMPT), want)


def test_unwritable_packed_dir_keeps_weights_private(tiny: ResolvedModel, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    loaded = load(tiny, "float32", tmp_path / "a-file" / "packed")
    want = prefill_logits(load(tiny, "float32", None), PROMPT)
    assert torch.equal(prefill_logits(loaded, PROMPT), want)


def test_tied_embedding_is_read_from_the_packed_head(loaded_fp32: LoadedModel) -> None:
    model = loaded_fp32.model
    assert loaded_fp32.arch.tie_word_embeddings
    if model.gemm.reads_rows:
        assert model.embed is None  # no dense copy next to the packed head
    with safe_open(str(loaded_fp32.folder / "model.safetensors"), framework="pt") as f:
        dense = f.get_tensor("model.embed_tokens.weight")
    ids = torch.tensor([0, 1, 47, 48, 95, 96, 12345, loaded_fp32.arch.vocab_size - 1, 1])
    assert torch.equal(model.embed_tokens(ids), F.embedding(ids, dense))


def test_a_new_packing_replaces_the_old_file(tiny: ResolvedModel, tmp_path: Path) -> None:
    needs_a_packed_file("float32")
    packed = tmp_path / "packed"
    load(tiny, "float32", packed)
    (file,) = packed.glob("*.bin")
    # what an earlier kernel or checkpoint left: same model, dtype and backend
    stale = file.with_name(file.name.rsplit("-", 1)[0] + "-" + "0" * 16 + ".bin")
    file.rename(stale)
    other_dtype = packed / file.name.replace("float32", "bfloat16")
    other_dtype.write_bytes(b"")
    load(tiny, "float32", packed)
    assert file.exists() and not stale.exists()
    assert other_dtype.exists()


def test_an_edit_to_the_packing_code_names_another_file(tmp_path: Path) -> None:
    """Weights packed by other code (another checkout, an edited packer) are never mapped."""

    def packer_a() -> None: ...

    source = tmp_path / "packer_b.py"
    source.write_text("def packer_b():\n    return None\n")
    namespace: dict[str, object] = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)  # a module on disk
    packer_b = namespace["packer_b"]
    assert callable(packer_b)
    before = packing_code(packer_a, packer_b)
    assert packing_code(packer_a, packer_b) == before
    source.write_text("def packer_b():\n    return 1\n")
    assert packing_code(packer_a, packer_b) != before
    args = (tmp_path, "m", "m@x", tmp_path, "float32", "native", "native-abc")
    assert packed_path(*args, before) != packed_path(*args, packing_code(packer_a, packer_b))
