"""LoRA in a run: which linears ``[lora]`` adapts (checked before launch), and adapting this rank's
model after tensor parallelism converted it, before experts, pipeline stages and data parallelism wrap
it (see :mod:`polyshard.models.common.lora` for the adapter and its tp split).

Everything but the adapters is frozen, as PEFT freezes the base model: embeddings, norms and the head
too. The wrappers and the optimizer take trainable parameters only, so the base has no gradient, no
optimizer state and no place in dp's buckets or ZeRO's gradient shards."""

from __future__ import annotations

from torch import nn

from polyshard.models.anatomy import moe_layers
from polyshard.models.build import spec_of
from polyshard.models.common.lora import attach_lora, is_adapter
from polyshard.models.common.moe.lora import attach_expert_lora
from polyshard.models.lora_targets import Target, select_targets
from polyshard.trainer.config import Config
from polyshard.trainer.engine.peft_folder import read_peft
from polyshard.trainer.errors import ConfigError


def lora_targets(config: Config) -> list[Target]:
    """The linears ``config.lora`` adapts (none without a ``[lora]`` section); a ConfigError in one line
    for a target that matches nothing or a rank too large."""
    if config.lora is None:
        return []
    # Cached: the check builds the model on the meta device, and the planner validates many layouts of one
    # model (the model by its repr: a list field, layer_types, leaves the config itself unhashable)
    key = (repr(config.model), tuple(config.lora.target_list), config.lora.rank)
    if key not in _TARGETS:
        if len(_TARGETS) >= 32:
            _TARGETS.clear()
        _TARGETS[key] = select_targets(config.model, config.lora.target_list, config.lora.rank)
    return list(_TARGETS[key])


_TARGETS: dict[tuple[str, tuple[str, ...], int], list[Target]] = {}


def check_lora(config: Config) -> None:
    """Before launch: the targets exist, the rank fits them, and a ``lora.init`` PEFT folder is a LoRA
    adapter of this model (each a one-line error naming the setting or the file); ``model.frozen_dtype``
    has a frozen base to keep."""
    _check_frozen_dtype(config)
    lora_targets(config)
    _check_experts(config)
    read_peft(config)


def _check_experts(config: Config) -> None:
    lora = config.lora
    if lora is None or not lora.experts:
        return
    if not spec_of(config.model).has_experts:
        raise ConfigError(
            f"lora.experts = true adapts routed experts, but model.kind={config.model.kind!r} has none; "
            "set lora.experts = false or choose an MoE model"
        )
    if lora.init is not None:
        raise ConfigError(
            f"lora.init={lora.init!r} with lora.experts = true: a PEFT folder's adapters are read onto the linears "
            "only; start the expert adapters fresh (unset lora.init) or set lora.experts = false"
        )


def _check_frozen_dtype(config: Config) -> None:
    dtype = config.model.frozen_dtype
    if dtype is None:
        return
    if config.lora is None:
        raise ConfigError(
            f"model.frozen_dtype={dtype!r} keeps a LoRA run's frozen base in {dtype}, but there is no [lora] "
            "section: add one (e.g. [lora] rank = 8) or unset model.frozen_dtype"
        )
    if config.training.precision != "fp32":
        raise ConfigError(
            f"model.frozen_dtype={dtype!r} with training.precision={config.training.precision!r}: mixed precision "
            "already keeps the frozen base in bf16; unset model.frozen_dtype or set training.precision = 'fp32'"
        )
    if config.training.loss_chunks > 1:
        raise ConfigError(
            f"model.frozen_dtype={dtype!r} with training.loss_chunks={config.training.loss_chunks}: the chunked "
            "loss multiplies float32 hidden states by the head's weight itself; set loss_chunks = 0"
        )


def apply_lora(model: nn.Module, config: Config) -> int:
    """Adapt the targets this rank holds in ``model`` (names ``layers.<i>....``), and with ``lora.experts``
    its routed experts' stacked weights, and freeze the rest; returns how many matrices were adapted here."""
    lora = config.lora
    if lora is None:
        return 0
    adapted, read = 0, read_peft(config)  # lora.init = "peft:DIR": every rank reads the (small) adapters
    for target in lora_targets(config):
        try:
            linear = model.get_submodule(target.name)
        except AttributeError:
            continue  # another pipeline rank's layer
        attach_lora(
            linear,
            target.name,
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=lora.dropout,
            rslora=lora.rslora,
            seed=config.training.seed,
            initial=read.get(target.name),
        )
        adapted += 1
    if lora.experts:  # after ep: this rank's experts' adapters only
        for name, layer in moe_layers(model):
            adapted += attach_expert_lora(
                layer,
                name,
                rank=lora.rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                rslora=lora.rslora,
                seed=config.training.seed,
            )
    for name, param in model.named_parameters():
        if not is_adapter(name):
            param.requires_grad_(False)
    return adapted
