"""``model.frozen_dtype``: a LoRA run's frozen base kept in bf16 (or fp16) while the adapters and their AdamW
state stay float32 (QLoRA's "compute dtype" idea without the 4-bit storage, 2305.14314; PEFT on a base
loaded with ``torch_dtype=torch.bfloat16``).

Which tensors: every module whose own parameters are frozen and include a matrix (a linear, an embedding,
stacked experts, a convolution) keeps them all in the frozen dtype (a linear's bias with its weight);
1-D-only modules (norms, attention sinks) stay float32: they are a tiny share of the bytes and a norm in
bf16 loses most. The choice is *compute in the frozen dtype*, not *cast the weight up for each use*: a
module's floating inputs are cast to its dtype on the way in and its outputs back to float32 on the way
out, so autograd saves bf16 weights and inputs (an up-cast weight would be saved in float32 for the
backward, and the memory would come back). An adapted linear computes ``base(x)`` in bf16 and adds the
float32 update ``B A x`` (the adapter reads the input as its base does, rounded to bf16, as PEFT's adapter
on a bf16 base reads bf16 hidden states).

Effect on parity: a run with a bf16 base differs from the float32 run by bf16 round-off of the frozen
weights and of the base products (relative 2^-8 each): ``tests/trainer/test_lora_memory.py`` bounds its
losses against the float32 run's. Under tp a row-parallel base without an adapter reduces its partial
sums in bf16.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from polyshard.trainer.config import Config

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in ``value`` (nested tuples, lists, dicts) cast to ``dtype``; the rest as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _frozen_own(module: nn.Module) -> list[nn.Parameter]:
    """The module's own frozen floating parameters if they include a matrix (else none): a linear's weight and
    bias, or stacked experts' weights beside their own adapters (``lora.experts``), which stay float32."""
    own = [p for p in module.parameters(recurse=False) if p.is_floating_point() and not p.requires_grad]
    return own if any(p.dim() >= 2 for p in own) else []


def keep_frozen_in_dtype(model: nn.Module, config: Config) -> int:
    """Cast the frozen base's matrices of ``model`` (after :func:`~polyshard.trainer.engine.lora.apply_lora`,
    before data parallelism wraps it) to ``model.frozen_dtype`` and make their modules compute in it;
    returns how many modules were converted (0 when the setting is unset)."""
    if config.model.frozen_dtype is None:
        return 0
    dtype = DTYPES[config.model.frozen_dtype]

    def cast_in(_module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return _cast(args, dtype), _cast(kwargs, dtype)

    def cast_out(_module: nn.Module, _args: Any, output: Any) -> Any:
        return _cast(output, torch.float32)

    converted = 0
    for module in model.modules():
        frozen = _frozen_own(module)
        if not frozen:
            continue
        for param in frozen:
            param.data = param.data.to(dtype)  # the same Parameter: its name and placement record stay
        module.register_forward_pre_hook(cast_in, with_kwargs=True)
        module.register_forward_hook(cast_out)
        converted += 1
    return converted
