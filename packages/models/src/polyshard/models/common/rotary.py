"""Rotary position embedding (Su et al. 2104.09864) and its frequency scalings: Llama 3.1's and YaRN
(Peng et al. 2309.00071; gpt-oss, DeepSeek-V3).

Shapes: B batch, S sequence, D head dim, N heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from polyshard.models.errors import ConfigError, check_choice

SCALINGS = ("none", "llama3", "yarn")
"""``model.rope.scaling``'s choices (Hugging Face's ``rope_type``: default, llama3, yarn)."""


@dataclass(kw_only=True, frozen=True)
class RopeConfig:
    """Rotary positions (``[model.rope]``): the base ``theta`` and a frequency scaling that stretches a
    model trained on ``original_context`` positions to ``factor`` times as many. The scaling rules
    (Hugging Face's ``rope_type``):

    * ``none``: theta^(-2i/D) as it is (``factor`` must stay 1).
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
      32 / 1, no truncation, original 4096.

    A rule with ``factor`` 1 changes nothing (a family may name its rule and leave the factor to a preset).
    0.4's flat ``[model]`` keys ``rope_theta``, ``rope_scale_factor``, ``rope_type``, ``rope_*`` still read
    (:mod:`polyshard.models.legacy`)."""

    theta: float = 10000.0
    """Base of the rotary frequencies; Llama 3 uses 500000."""
    scaling: str = "none"
    """The frequency scaling: none, llama3 (Llama 3.1+) or yarn (gpt-oss, DeepSeek-V3); applies when factor > 1."""
    factor: float = 1.0
    """The context the scaling stretches to over original_context; 1: no scaling (Llama 3.2: 32, gpt-oss: 32)."""
    original_context: int = 8192
    """The context length the model was first trained on (Llama 3: 8192; gpt-oss and DeepSeek: 4096)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_context / this are scaled fully."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_context / this are kept; those between are blended."""
    beta_fast: float = 32.0
    """yarn: dims turning more than this many times over original_context keep their frequency."""
    beta_slow: float = 1.0
    """yarn: dims turning fewer than this many times are divided by the factor (a ramp between)."""
    truncate: bool = True
    """yarn: round the ramp's ends outward to whole dims (Hugging Face's truncate; gpt-oss: false)."""
    mscale: float | None = None
    """yarn (DeepSeek): with mscale_all_dim, the attention scale is mscale(f, this) / mscale(f, that)."""
    mscale_all_dim: float | None = None
    """yarn (DeepSeek): see mscale; DeepSeek's softmax scale also takes mscale(f, this) squared."""
    attention_factor: float | None = None
    """yarn: the factor on cos and sin when set; unset: from mscale*, else 0.1 ln(factor) + 1."""

    def __post_init__(self) -> None:
        if not (isinstance(self.theta, (int, float)) and math.isfinite(self.theta) and self.theta > 0):
            raise ConfigError(f"model.rope.theta={self.theta} must be a finite number > 0 (10000; Llama 3: 500000)")
        check_choice("model.rope.scaling", self.scaling, SCALINGS)
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ConfigError(f"model.rope.factor={self.factor} must be a finite number >= 1 (1: no scaling)")
        if self.scaling == "none" and self.factor != 1.0:
            raise ConfigError(
                f"model.rope.factor={self.factor} stretches the context by a rule: set model.rope.scaling to "
                "'llama3' (Llama 3.1+) or 'yarn' (gpt-oss, DeepSeek), or factor = 1"
            )
        if not (isinstance(self.original_context, int) and self.original_context >= 1):
            raise ConfigError(f"model.rope.original_context={self.original_context} must be >= 1 (Llama 3: 8192)")
        if self.scaling == "yarn":
            self._check_yarn()
        elif not (0.0 < self.low_freq_factor < self.high_freq_factor and math.isfinite(self.high_freq_factor)):
            raise ConfigError(
                f"model.rope.low_freq_factor={self.low_freq_factor} and model.rope.high_freq_factor="
                f"{self.high_freq_factor} need 0 < low < high (Llama 3 uses 1 and 4)"
            )

    def _check_yarn(self) -> None:
        if not (math.isfinite(self.beta_fast) and math.isfinite(self.beta_slow) and 0 < self.beta_slow):
            raise ConfigError(
                f"model.rope.beta_fast={self.beta_fast} and model.rope.beta_slow={self.beta_slow} must be finite "
                "and > 0 (YaRN's defaults: 32 and 1)"
            )
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"model.rope.{name}={value} must be a finite number > 0, or unset")

    @property
    def stretched(self) -> bool:
        """Whether the scaling changes anything (a rule other than none, with factor > 1)."""
        return self.scaling != "none" and self.factor != 1.0

    @property
    def attention_scale(self) -> float:
        """The factor on cos and sin: 1 unless YaRN stretches (see the class)."""
        if not self.stretched or self.scaling != "yarn":
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


def _yarn_frequencies(head_dim: int, rope: RopeConfig, device: torch.device | None) -> torch.Tensor:
    """YaRN's blend of the original frequencies (fast dims) and those divided by the factor (slow dims),
    in the order of operations transformers' ``_compute_yarn_parameters`` uses."""
    theta = rope.theta
    powers = theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).to(torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (rope.factor * powers)

    def dim_of(rotations: float) -> float:  # the dim that turns ``rotations`` times over the original context
        return head_dim * math.log(rope.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    keep = 1 - ramp  # 1: the dim keeps its frequency; 0: divided by the factor
    return interpolated * (1 - keep) + extrapolated * keep


def rope_frequencies(head_dim: int, rope: RopeConfig, device: torch.device | None = None) -> torch.Tensor:
    """The D/2 rotation frequencies theta^(-2i/D) in float32, computed as transformers computes them
    (1 / theta^(2i/D), bit for bit); when ``rope`` stretches, rescaled by exactly the rule (and the order
    of operations) of its ``_compute_llama3_parameters`` or ``_compute_yarn_parameters``."""
    if rope.stretched and rope.scaling == "yarn":
        return _yarn_frequencies(head_dim, rope, device)
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).to(torch.float32) / head_dim
    inv = 1.0 / (rope.theta**exponents)
    if not rope.stretched:
        return inv
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    wavelength = 2 * math.pi / inv
    long_wavelength, short_wavelength = rope.original_context / low, rope.original_context / high
    scaled = torch.where(wavelength > long_wavelength, inv / factor, inv)  # low frequencies: slowed down
    smooth = (rope.original_context / wavelength - low) / (high - low)  # 0 at long, 1 at short
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return torch.where(between, smoothed, scaled)


def rotate(x: torch.Tensor, rope: RopeConfig, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2104.09864) of ``x`` (B, N, S, D), in the half-split
    layout Llama and Hugging Face use: dims i and i + D/2 form a pair rotated by pos x theta^(-2i/D)
    (frequencies rescaled by ``rope``'s scaling for Llama 3.1's or YaRN's long context, and YaRN's
    attention scale on cos and sin).
    ``positions`` (S,) are the tokens' positions in their sequence: 0..S-1 by default; context
    parallelism, where a rank holds two chunks of the sequence, passes theirs; document masking passes
    (B, S), each row's positions within its documents."""
    d, s = x.shape[-1], x.shape[-2]
    inv = rope_frequencies(d, rope, x.device)
    pos = torch.arange(s, device=x.device) if positions is None else positions.to(x.device)
    if pos.dim() == 1:
        angles = torch.outer(pos.to(torch.float32), inv)  # (S, D/2)
    else:  # per row: (B, S, 1) * (D/2,) -> (B, 1, S, D/2), broadcast over the heads
        angles = (pos.to(torch.float32).unsqueeze(-1) * inv).unsqueeze(1)
    twice = (1,) * (angles.dim() - 1) + (2,)  # the D/2 angles for dims i and i + D/2
    cos, sin = angles.cos(), angles.sin()
    if rope.attention_scale != 1.0:
        cos, sin = cos * rope.attention_scale, sin * rope.attention_scale
    cos, sin = cos.repeat(twice), sin.repeat(twice)  # (S, D) or (B, 1, S, D)
    x32 = x.float()
    half = torch.cat([-x32[..., d // 2 :], x32[..., : d // 2]], dim=-1)
    return (x32 * cos + half * sin).to(x.dtype)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary layout to the half-split one :func:`rotate` expects: dims (0, 1), (2, 3), ... are
    its pairs; this puts the even dims first and the odd ones after, so pair i is dims i and i + D/2
    (what transformers' ``apply_rotary_pos_emb_interleave`` computes, rotated in the same output order)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
