"""Rotary position embedding (Su et al. 2104.09864) and Llama 3.1's frequency scaling.

Shapes: B batch, S sequence, D head dim, N heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (Hugging Face's ``rope_type = "llama3"``), which stretches
    a model trained on ``original_context`` positions to ``factor`` times as many: a frequency whose
    wavelength exceeds ``original_context / low_freq_factor`` is divided by ``factor``, one whose
    wavelength is below ``original_context / high_freq_factor`` is kept, and those between move
    smoothly from one to the other. Llama 3.2: factor 32, low 1, high 4, original 8192."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    def __post_init__(self) -> None:
        # Named as a config's [model] fields (rope_scale_factor, ...), which give these numbers.
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"rope_scale_factor={self.factor} must be a finite number >= 1 (1: no scaling)")
        if not (0.0 < self.low_freq_factor < self.high_freq_factor and math.isfinite(self.high_freq_factor)):
            raise ValueError(
                f"rope_low_freq_factor={self.low_freq_factor} and rope_high_freq_factor={self.high_freq_factor} "
                f"need 0 < low < high (Llama 3 uses 1 and 4)"
            )
        if self.original_context < 1:
            raise ValueError(f"rope_original_context={self.original_context} must be >= 1 (Llama 3: 8192)")


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The D/2 rotation frequencies theta^(-2i/D) in float32, computed as transformers computes them
    (1 / theta^(2i/D), bit for bit); with ``scaling`` rescaled by exactly the rule (and the order of
    operations) of its ``_compute_llama3_parameters``."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).to(torch.float32) / head_dim
    inv = 1.0 / (theta**exponents)
    if scaling is None:
        return inv
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv
    long_wavelength, short_wavelength = scaling.original_context / low, scaling.original_context / high
    scaled = torch.where(wavelength > long_wavelength, inv / factor, inv)  # low frequencies: slowed down
    smooth = (scaling.original_context / wavelength - low) / (high - low)  # 0 at long, 1 at short
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return torch.where(between, smoothed, scaled)


def rotate(
    x: torch.Tensor, theta: float, scaling: RopeScaling | None = None, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2104.09864) of ``x`` (B, N, S, D), in the half-split
    layout Llama and Hugging Face use: dims i and i + D/2 form a pair rotated by pos x theta^(-2i/D)
    (frequencies rescaled by ``scaling`` for Llama 3.1's long context).
    ``positions`` (S,) are the tokens' positions in their sequence: 0..S-1 by default; context
    parallelism, where a rank holds two chunks of the sequence, passes theirs; document masking passes
    (B, S), each row's positions within its documents."""
    d, s = x.shape[-1], x.shape[-2]
    inv = rope_frequencies(d, theta, scaling, x.device)
    pos = torch.arange(s, device=x.device) if positions is None else positions.to(x.device)
    if pos.dim() == 1:
        angles = torch.outer(pos.to(torch.float32), inv)  # (S, D/2)
    else:  # per row: (B, S, 1) * (D/2,) -> (B, 1, S, D/2), broadcast over the heads
        angles = (pos.to(torch.float32).unsqueeze(-1) * inv).unsqueeze(1)
    twice = (1,) * (angles.dim() - 1) + (2,)  # the D/2 angles for dims i and i + D/2
    cos, sin = angles.cos().repeat(twice), angles.sin().repeat(twice)  # (S, D) or (B, 1, S, D)
    x32 = x.float()
    half = torch.cat([-x32[..., d // 2 :], x32[..., : d // 2]], dim=-1)
    return (x32 * cos + half * sin).to(x.dtype)
