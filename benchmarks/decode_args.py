"""What the scripts that probe the engine's decode steps share: their command
line (dtype, threads, batch sizes, context, repeats, output) and the model."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from shared.config import default_cache_dir
from shared.model.loader import LoadedModel, load_model


def decode_parser(doc: str, *, repeats: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--out", type=Path, default=None)
    return p


def load_default_model(args: argparse.Namespace) -> LoadedModel:
    """The embedded default model in ``args.dtype``, torch on ``args.threads`` threads."""
    torch.set_num_threads(args.threads)
    return load_model(None, cache_dir=default_cache_dir(), dtype=args.dtype, progress=False)
