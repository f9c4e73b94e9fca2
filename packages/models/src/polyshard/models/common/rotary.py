"""Rotary position embedding (Su et al. 2104.09864) and its frequency scalings: Llama 3.1's and YaRN
(Peng et al. 2309.00071; gpt-oss, DeepSeek-V3).

Shapes: B batch, S sequence, D head dim, N heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_KINDS = ("llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A rotary frequency scaling that stretches a model trained on ``original_context`` positions to
    ``factor`` times as many. Two kinds (Hugging Face's ``rope_type``):

    * ``llama3`` (Llama 3.1): a frequency whose wavelength exceeds ``original_context / low_freq_factor``
      is divided by ``factor``, one whose wavelength is below ``original_context / high_freq_factor`` is
      kept, and those between move smoothly from one to the other. Llama 3.2: factor 32, low 1, high 4,
      original 8192.
    * ``yarn`` (Peng et al. 2309.00071; gpt-oss, DeepSeek-V3): dims that turn more than ``beta_fast``
      times over the original context keep their frequency, those turning fewer than ``beta_slow`` times
      are divided by ``factor``, a linear ramp between (its ends rounded outward when ``truncate``); and
      cos and sin are multiplied by :attr:`attention_scale` (so every attention logit by its square).
      That scale is ``attention_factor`` when set, else mscale(factor, mscale) / mscale(factor,
      mscale_all_dim) when both are set (DeepSeek), else 0.1 ln(factor) + 1. gpt-oss: factor 32, beta
      32 / 1, no truncation, original 4096."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        # Named as a config's [model] fields (rope_scale_factor, ...), which give these numbers.
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope_type={self.kind!r} is unknown; choose one of {ROPE_KINDS}")
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"rope_scale_factor={self.factor} must be a finite number >= 1 (1: no scaling)")
        if self.original_context < 1:
            raise ValueError(f"rope_original_context={self.original_context} must be >= 1 (Llama 3: 8192)")
        if self.kind == "yarn":
            self._check_yarn()
            return
        if not (0.0 < self.low_freq_factor < self.high_freq_factor and math.isfinite(self.high_freq_factor)):
            raise ValueError(
                f"rope_low_freq_factor={self.low_freq_factor} and rope_high_freq_factor={self.high_freq_factor} "
                f"need 0 < low < high (Llama 3 uses 1 and 4)"
            )

    def _check_yarn(self) -> None:
        if not (math.isfinite(self.beta_fast) and math.isfinite(self.beta_slow) and 0 < self.beta_slow):
            raise ValueError(
                f"rope_beta_fast={self.beta_fast} and rope_beta_slow={self.beta_slow} must be finite and > 0 "
                "(YaRN's defaults: 32 and 1)"
            )
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"rope_{name}={value} must be a finite number > 0, or unset")

    @property
    def attention_scale(self) -> float:
        """The factor on cos and sin: 1 for llama3; YaRN's attention factor (see the class)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 m ln(s) + 1 (1 for s <= 1); DeepSeek also multiplies its softmax
    scale by mscale(factor, mscale_all_dim) squared."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(head_dim: int, theta: float, scaling: RopeScaling, device: torch.device | None) -> torch.Tensor:
    """YaRN's blend of the original frequencies (fast dims) and those divided by the factor (slow dims),
    in the order of operations transformers' ``_compute_yarn_parameters`` uses."""
    powers = theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).to(torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (scaling.factor * powers)

    def dim_of(rotations: float) -> float:  # the dim that turns ``rotations`` times over the original context
        return head_dim * math.log(scaling.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    keep = 1 - ramp  # 1: the dim keeps its frequency; 0: divided by the factor
    return interpolated * (1 - keep) + extrapolated * keep


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The D/2 rotation frequencies theta^(-2i/D) in float32, computed as transformers computes them
    (1 / theta^(2i/D), bit for bit); with ``scaling`` rescaled by exactly the rule (and the order of
    operations) of its ``_compute_llama3_parameters``."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).to(torch.float32) / head_dim
    if scaling is not None and scaling.kind == "yarn":
        return _yarn_frequencies(head_dim, theta, scaling, device)
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
    (frequencies rescaled by ``scaling`` for Llama 3.1's or YaRN's long context, and YaRN's attention
    scale on cos and sin).
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
    cos, sin = angles.cos(), angles.sin()
    if scaling is not None and scaling.attention_scale != 1.0:
        cos, sin = cos * scaling.attention_scale, sin * scaling.attention_scale
    cos, sin = cos.repeat(twice), sin.repeat(twice)  # (S, D) or (B, 1, S, D)
    x32 = x.float()
    half = torch.cat([-x32[..., d // 2 :], x32[..., : d // 2]], dim=-1)
    return (x32 * cos + half * sin).to(x.dtype)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary layout to the half-split one :func:`rotate` expects: dims (0, 1), (2, 3), ... are
    its pairs; this puts the even dims first and the odd ones after, so pair i is dims i and i + D/2
    (what transformers' ``apply_rotary_pos_emb_interleave`` computes, rotated in the same output order)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
