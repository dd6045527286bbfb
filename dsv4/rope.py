"""Rotary position embedding, interleaved pairs on the last R dims, with optional YaRN
(docs/model.md §2.2–§2.3). This module owns the frequencies and their application; it keeps
no position table and no state.

Dimension legend: S = positions (dim 0 of every roped tensor), ... = middle dims (heads),
Dh = vector width, R = rope_head_dim (the roped tail, x[..., Dh-R:]), F = R/2 frequencies.

Pair k of the tail is the complex number x[2k] + i*x[2k+1]; it is multiplied by
exp(i * pos * inv_freq[k]) (by the conjugate when `inverse`). Angles are computed on the fly
from `inv_freq` (fp32, the same products the reference's precomputed table holds), so no
[max_seq_len, F] table is allocated.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv4.config import ModelConfig


def rope_inv_freq(rope_dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """Inverse frequencies [F] fp32 (docs/model.md §2.2); YaRN-interpolated when `original_seq_len` > 0.

    YaRN: corr(n) = R ln(orig / (2 pi n)) / (2 ln base); lo = max(floor(corr(beta_fast)), 0),
    hi = min(ceil(corr(beta_slow)), R - 1); ramp[j] = clamp((j - lo) / (hi - lo), 0, 1);
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp).
    Raises:
        ValueError: `rope_dim` not a positive even number.
    """
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim={rope_dim}: must be a positive even number")
    inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))  # [F]
    if original_seq_len <= 0:
        return inv_freq
    lo, hi = yarn_ramp_bounds(rope_dim, base, original_seq_len, beta_fast, beta_slow)
    if lo == hi:
        hi += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)  # [F]
    keep = 1 - ramp
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_ramp_bounds(rope_dim: int, base: float, original_seq_len: int,
                     beta_fast: float, beta_slow: float) -> tuple[int, int]:
    """The YaRN ramp's (lo, hi) frequency indices (docs/model.md §2.2)."""
    def corr(n_rot: float) -> float:
        return rope_dim * math.log(original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(corr(beta_fast)), 0)
    hi = min(math.ceil(corr(beta_slow)), rope_dim - 1)
    return lo, hi


def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last R = 2*len(inv_freq) dims of x [S, ..., Dh] by positions pos [S] (int).

    Computed in fp32; returns a new tensor in x.dtype (the first Dh-R dims copied unchanged).
    `inverse=True` rotates by -angle (undoes a forward rotation at the same position).
    """
    rope_dim = 2 * inv_freq.shape[0]
    angle = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # [S, F]
    angle = angle.view(angle.shape[0], *([1] * (x.ndim - 2)), angle.shape[1])  # [S, 1.., F]
    cos, sin = torch.cos(angle), torch.sin(angle)
    if inverse:
        sin = -sin
    tail = x[..., -rope_dim:].float().unflatten(-1, (-1, 2))  # [S, ..., F, 2]
    re, im = tail[..., 0], tail[..., 1]
    rotated = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)  # [S, ..., R]
    return torch.cat((x[..., :-rope_dim], rotated.to(x.dtype)), dim=-1)


class Rope(nn.Module):
    """One rope table (base, YaRN or not) as a non-persistent `inv_freq` [F] fp32 buffer.

    `Rope.for_layer(cfg, layer_id)`: compressed layers (ratio > 0) use
    (compress_rope_theta, YaRN with original_seq_len / rope_factor / beta_*); ratio-0 layers
    and DSpark stages use (rope_theta, no YaRN) (docs/model.md §2.2). A layer's compressor and indexer
    share its table.
    """

    def __init__(self, inv_freq: torch.Tensor, device: torch.device | str = "cpu"):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    @classmethod
    def for_layer(cls, cfg: ModelConfig, layer_id: int, device: torch.device | str = "cpu") -> "Rope":
        if cfg.layer_ratio(layer_id):
            inv = rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len,
                                cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
        else:
            inv = rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta)
        return cls(inv, device)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """See `apply_rope`: x [S, ..., Dh], pos [S] -> same shape and dtype."""
        return apply_rope(x, pos, self.inv_freq, inverse)
