"""Rotary position embedding tables (rotate-half convention), with HF ``rope_scaling``."""

from __future__ import annotations

import math

import torch

from shared.model.arch import ModelArch


def inv_frequencies(arch: ModelArch, *, local: bool = False) -> torch.Tensor:
    """``local``: the frequencies of sliding-window layers (their own base, unscaled)."""
    dim = arch.head_dim
    theta = arch.rope_local_theta if local and arch.rope_local_theta else arch.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = None if local else arch.rope_scaling
    if rs is None:
        return inv
    if rs.rope_type == "linear":
        return inv / rs.factor
    # llama3: scale low frequencies, keep high ones, blend in between
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class Rope:
    """Precomputed cos/sin ``[max_position, head_dim]`` (contiguous) for every
    position up to the model's context length."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: str, *, local: bool = False):
        self.head_dim = arch.head_dim
        inv = inv_frequencies(arch, local=local).float()
        pos = torch.arange(arch.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[N, 1, head_dim]`` for ``positions``."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (``[N, heads, head_dim]``) by the angles :meth:`at` returned."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
