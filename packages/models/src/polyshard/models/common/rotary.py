"""Rotary position embedding (Su et al. 2104.09864), Llama 3.1's frequency scaling and YaRN's
(Peng et al. 2309.00071, DeepSeek-V2/V3).

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


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2309.00071; Hugging Face's ``rope_type = "yarn"``, DeepSeek-V2/V3's long
    context): each frequency is blended between itself (extrapolation, the fast ones) and itself /
    ``factor`` (interpolation, the slow ones), by a linear ramp over the dims whose number of rotations
    within ``original_context`` positions lies between ``beta_slow`` and ``beta_fast``. Its cos and sin
    are multiplied by :attr:`attention_factor`; DeepSeek also multiplies the softmax scale by
    ``mscale(factor, mscale_all_dim)`` squared (:func:`yarn_mscale`), which its attention applies."""

    factor: float
    original_context: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"yarn_factor={self.factor} must be a finite number >= 1 (1: no scaling)")
        if self.original_context < 1:
            raise ValueError(f"yarn_original_context={self.original_context} must be >= 1 (DeepSeek-V3: 4096)")
        if not 0.0 < self.beta_slow < self.beta_fast:
            raise ValueError(
                f"yarn_beta_slow={self.beta_slow} and yarn_beta_fast={self.beta_fast} need 0 < slow < fast"
            )
        if self.mscale < 0 or self.mscale_all_dim < 0:
            raise ValueError(f"yarn_mscale={self.mscale} and yarn_mscale_all_dim={self.mscale_all_dim} must be >= 0")

    @property
    def attention_factor(self) -> float:
        """The factor on cos and sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
        set (DeepSeek: 1 / 1), else mscale(factor)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def frequencies(self, head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
        """The D/2 blended frequencies, computed in the order transformers' ``_compute_yarn_parameters`` does."""

        def correction_dim(rotations: float) -> float:  # the dim that turns ``rotations`` times in the context
            return head_dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high: float = min(math.ceil(correction_dim(self.beta_slow)), head_dim - 1)
        if low == high:
            high += 0.001  # a ramp of zero width would divide by zero
        powers = theta ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim)
        extrapolated, interpolated = 1.0 / powers, 1.0 / (self.factor * powers)
        ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp.to(device=device, dtype=torch.float)  # 1: the fast dims, extrapolated as they are
        return interpolated * (1 - keep) + extrapolated * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 x mscale x ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The D/2 rotation frequencies theta^(-2i/D) in float32, computed as transformers computes them
    (1 / theta^(2i/D), bit for bit); with ``scaling`` rescaled by exactly the rule (and the order of
    operations) of its ``_compute_llama3_parameters``."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).to(torch.float32) / head_dim
    inv = 1.0 / (theta**exponents)
    if scaling is None:
        return inv
    if isinstance(scaling, YarnScaling):
        return scaling.frequencies(head_dim, theta, device)
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv
    long_wavelength, short_wavelength = scaling.original_context / low, scaling.original_context / high
    scaled = torch.where(wavelength > long_wavelength, inv / factor, inv)  # low frequencies: slowed down
    smooth = (scaling.original_context / wavelength - low) / (high - low)  # 0 at long, 1 at short
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return torch.where(between, smoothed, scaled)


def rotate(
    x: torch.Tensor,
    theta: float,
    scaling: RopeScaling | YarnScaling | None = None,
    positions: torch.Tensor | None = None,
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
    if isinstance(scaling, YarnScaling) and scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    x32 = x.float()
    half = torch.cat([-x32[..., d // 2 :], x32[..., : d // 2]], dim=-1)
    return (x32 * cos + half * sin).to(x.dtype)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary layout to the half-split one :func:`rotate` expects: dims (0, 1), (2, 3), ... are
    its pairs; this puts the even dims first and the odd ones after, so pair i is dims i and i + D/2
    (what transformers' ``apply_rotary_pos_emb_interleave`` computes, rotated in the same output order)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
