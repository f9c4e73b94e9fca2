"""The optimizer of a stage, chosen in one place: ``training.optimizer``'s AdamW or Muon over the stage's
parameters, in the groups :mod:`.optim` forms, wrapped to step ZeRO's (or bf16's) fp32 master rows."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from polyshard.dp import DataParallelWrapper, Muon, ZeroOptimizer
from polyshard.mesh import Mesh
from polyshard.models import spec_of
from polyshard.trainer.config import Config
from polyshard.trainer.engine.layout import keeps_masters
from polyshard.trainer.engine.optim import adamw_kernel, decay_rule, muon_groups, param_groups


def build_optimizer(
    wrapper: DataParallelWrapper, config: Config, names: Mapping[str, str], mesh: Mesh
) -> torch.optim.Optimizer | ZeroOptimizer:
    """The one place the optimizer is chosen: ``training.optimizer``'s AdamW or Muon over the stage's
    parameters (by model ``names``), wrapped to step ZeRO's (or bf16's) fp32 master rows."""
    train, spec = config.training, spec_of(config.model)
    named = [(names[n], p) for n, p in wrapper.module.named_parameters()]
    decays, kernel = decay_rule(train, spec.decays), adamw_kernel(train)
    inner: torch.optim.Optimizer
    if train.optimizer == "muon":
        # Muon reads each stepped tensor's placement record (ZeRO's masters carry theirs) and gathers a
        # split matrix over the mesh axes the record names: see polyshard.dp.muon.
        inner = Muon(
            muon_groups(named, train.weight_decay, decays, spec.orthogonalised),
            mesh=mesh,
            lr=train.lr,
            momentum=train.muon_momentum,
            nesterov=train.muon_nesterov,
            ns_steps=train.muon_ns_steps,
            betas=(train.beta1, train.beta2),
            **kernel,
        )
    else:
        groups = param_groups(named, train.weight_decay, decays)
        inner = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), **kernel)
    if not keeps_masters(config):
        return inner  # gradients are full and averaged in place: a plain optimizer suffices
    return ZeroOptimizer(inner, wrapper)
