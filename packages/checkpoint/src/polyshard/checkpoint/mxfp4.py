"""MXFP4 (the OCP microscaling format), as OpenAI's gpt-oss folders store their experts: a weight ``W``
of shape (..., rows, cols) is kept as

* ``<name>_blocks`` uint8 (..., rows, cols / 32, 16): 32 four-bit e2m1 values per block, two to a byte,
  the low nibble first;
* ``<name>_scales`` uint8 (..., rows, cols / 32): one e8m0 scale per block, the power of two 2^(s - 127).

e2m1 is a sign bit, two exponent bits and one mantissa bit: the 16 codes are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
their negatives. gpt-oss stores each Linear-style (out, in) weight so; the model's tensor is its transpose
over the last two dims, which :func:`dequantize` returns.

Values that cannot be weights are refused, not trained on: a scale byte of 255 is e8m0's NaN (OCP MX 1.0,
section 5.4.1), and one of 253 or 254 times a large code overflows float32 to infinity.
:func:`check_header` and :func:`nan_scales` see the first before launch, from the file's header and its
scales (1/16 of the blocks' bytes); :func:`dequantize` refuses any non-finite value it makes.
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
SCALE_BIAS = 127  # e8m0's exponent bias
NAN_SCALE = 255  # e8m0's one reserved code: NaN
STORED_DTYPE = "U8"  # safetensors' name of the dtype blocks and scales are stored in


def check_header(blocks_dtype: str, scales_dtype: str) -> None:
    """A ValueError unless both parts are stored as bytes (a header saying F32 is another format)."""
    if (blocks_dtype, scales_dtype) != (STORED_DTYPE, STORED_DTYPE):
        raise ValueError(
            f"MXFP4 blocks and scales are stored as {STORED_DTYPE} (bytes); the header says {blocks_dtype} and "
            f"{scales_dtype}: the file is damaged or in another format"
        )


def nan_scales(scales: torch.Tensor) -> int:
    """How many of ``scales`` (uint8) are e8m0's NaN code: each makes its whole block of 32 values NaN."""
    return int((scales == NAN_SCALE).sum())


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
    out = values.flatten(-2).transpose(-1, -2).to(dtype)
    if not bool(torch.isfinite(out).all()):  # a NaN scale, or a scale that overflows float32 (or ``dtype``)
        largest = int(scales.max())
        raise ValueError(
            f"dequantizes to NaN or infinite values (scale bytes up to {largest}: 2^{largest - SCALE_BIAS}"
            f"{', the NaN code' if largest == NAN_SCALE else ''}); the weights are damaged"
        )
    return out  # (..., R, G*32) -> (..., G*32, R)
