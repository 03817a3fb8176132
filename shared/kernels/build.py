"""Compile a C source shipped with the package into a shared library, once per machine.

The library's name carries a hash of everything that decides its machine code:
the source text and the headers beside it, the compiler flags, the compiler's
version and (because we build with ``-march=native``) the CPU's feature flags.
Concurrent first users (several services starting at once) serialise on a lock
file and all but one find the finished library; it is written to a temporary
name and renamed, so a half-written library is never loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from shared.errors import KernelBuildError
from shared.filelock import file_lock

log = logging.getLogger(__name__)

BASE_FLAGS = (
    "-O3",
    "-march=native",
    "-fPIC",
    "-shared",
    # vectorise float reductions and use FMA; no -ffast-math, so inf/NaN keep their meaning
    "-ffp-contract=fast",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
)
OPENMP_FLAGS = ("-fopenmp",)
COMPILE_TIMEOUT_S = 180.0


def find_compiler() -> str:
    """``$CC``, else ``cc`` or ``gcc`` on the PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError("no C compiler found (set CC, or install gcc)")


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"running {argv[0]} failed: {e}") from e


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key(source: str, compiler: str, flags: Sequence[str]) -> str:
    version = _run([compiler, "--version"]).stdout
    parts = [source, compiler, " ".join(flags), version, platform.machine(), _cpu_flags()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build_library(source_path: Path, out_dir: Path, extra_flags: Sequence[str] = ()) -> Path:
    """Path of the compiled library for ``source_path``, compiling it if this machine has none.

    Tries with OpenMP first and without it second (the kernel then runs on one
    thread). ``extra_flags`` follow the base ones (the tests build the form a CPU
    without one of this one's features runs, e.g. ``-mno-amx-tile``). Raises
    :class:`KernelBuildError` with the compiler's message when neither compiles.
    """
    compiler = find_compiler()
    source = _source_text(source_path)
    attempts = [(*BASE_FLAGS, *extra_flags, *OPENMP_FLAGS), (*BASE_FLAGS, *extra_flags)]
    errors: list[str] = []
    for flags in attempts:
        target = out_dir / f"{source_path.stem}-{build_key(source, compiler, flags)}.so"
        if target.exists():
            return target
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KernelBuildError(f"cannot create kernel directory {out_dir}: {e}") from e
        with file_lock(out_dir / f"{source_path.stem}.lock"):
            if target.exists():  # another process built it while we waited
                return target
            error = _compile(compiler, flags, source_path, target)
            if error is None:
                log.info("compiled kernel %s with %s", target.name, " ".join(flags))
                return target
            errors.append(error)
    raise KernelBuildError(f"compiling {source_path.name} failed: {errors[-1]}")


def _source_text(source_path: Path) -> str:
    """The source and every header in its folder (what ``#include "..."`` can reach)."""
    try:
        parts = [source_path.read_text()]
        parts += [h.read_text() for h in sorted(source_path.parent.glob("*.h"))]
    except OSError as e:
        raise KernelBuildError(f"cannot read kernel source {source_path}: {e}") from e
    return "\0".join(parts)


def _compile(compiler: str, flags: Sequence[str], source: Path, target: Path) -> str | None:
    """Compile ``source`` to ``target`` atomically; the compiler's error text on failure."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so")
    os.close(fd)
    try:
        proc = _run([compiler, *flags, "-o", tmp, str(source)])
        if proc.returncode != 0:
            return (proc.stderr or proc.stdout).strip()[-2000:]
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
