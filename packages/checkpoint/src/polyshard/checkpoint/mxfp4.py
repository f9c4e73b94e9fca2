"""MXFP4 (the OCP microscaling format), as OpenAI's gpt-oss folders store their experts: a weight ``W``
of shape (..., rows, cols) is kept as

* ``<name>_blocks`` uint8 (..., rows, cols / 32, 16): 32 four-bit e2m1 values per block, two to a byte,
  the low nibble first;
* ``<name>_scales`` uint8 (..., rows, cols / 32): one e8m0 scale per block, the power of two 2^(s - 127).

e2m1 is a sign bit, two exponent bits and one mantissa bit: the 16 codes are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
their negatives. gpt-oss stores each Linear-style (out, in) weight so; the model's tensor is its transpose
over the last two dims, which :func:`dequantize` returns.
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
SCALE_BIAS = 127  # e8m0's exponent bias


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., R, G, 16) uint8 blocks and (..., R, G) uint8 scales -> (..., G * 32, R) in ``dtype``: every
    value times its block's power of two (exact in float32 and bfloat16: e2m1 has one mantissa bit), the
    last two dims transposed (stored (out, in), returned (in, out))."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: blocks are "
            f"(..., rows, groups, {BLOCK // 2}) and scales (..., rows, groups)"
        )
    table = torch.tensor(E2M1, dtype=torch.float32)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]  # (..., R, G, 16) each
    values = torch.stack([low, high], dim=-1).flatten(-2)  # (..., R, G, 32): low nibble first
    exponents = scales.to(torch.int32) - SCALE_BIAS  # (..., R, G)
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).transpose(-1, -2).to(dtype)  # (..., R, G*32) -> (..., G*32, R)
