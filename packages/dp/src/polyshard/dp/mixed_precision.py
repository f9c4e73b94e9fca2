"""Mixed precision: low-precision compute with fp32 master weights (Micikevicius et al., 1710.03740).

The wrappers cast the module's parameters to ``param_dtype`` (e.g. bf16) for
forward and backward; :class:`polyshard.dp.ZeroOptimizer` keeps an fp32 master
copy of this rank's shard, steps it, and writes the rounded result back.
Gradients are reduced in ``reduce_dtype`` (fp32 keeps the sum of N bf16
gradients from losing bits; bf16 halves the bytes on the wire).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from polyshard.dp.errors import DataParallelError


@dataclass(kw_only=True, frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.bfloat16
    """dtype of the parameters used in forward and backward."""
    reduce_dtype: torch.dtype | None = None
    """dtype gradients are reduced in; None means ``param_dtype``."""

    def __post_init__(self) -> None:
        for field_name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field_name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise DataParallelError(
                    f"MixedPrecision.{field_name}={dtype!r} is not a floating dtype; "
                    "use torch.bfloat16, torch.float16 or torch.float32"
                )


def compute_dtype(param: torch.Tensor, mixed_precision: MixedPrecision | None) -> torch.dtype:
    return mixed_precision.param_dtype if mixed_precision else param.dtype


def reduce_dtype(param: torch.Tensor, mixed_precision: MixedPrecision | None) -> torch.dtype:
    if mixed_precision is None:
        return param.dtype
    return mixed_precision.reduce_dtype or mixed_precision.param_dtype


def cast_inputs(value: Any, dtype: torch.dtype) -> Any:
    """Cast floating tensors in (nested tuples/lists/dicts of) forward inputs to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_inputs(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_inputs(v, dtype) for k, v in value.items()}
    return value
