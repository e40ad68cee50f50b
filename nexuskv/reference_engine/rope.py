"""Rotary position embedding (rotate-half form), computed per absolute position.

Angles are computed in float64 from each token's absolute position and rounded once to the
compute dtype, so a position gets the same rotation whether it is computed in a full prefill or
in a continuation after a cached prefix — a requirement for reuse to equal recomputation.
"""

from __future__ import annotations

import torch

__all__ = ["rope_angles", "apply_rope"]


def rope_angles(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each ``[len(positions), dim]`` in float32, for rotate-half RoPE."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(torch.float32), emb.sin().to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, ..., dim]``) by per-token angles (``[T, dim]``)."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
