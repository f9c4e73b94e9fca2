"""The optimizer of a stage, chosen in one place: ``optimizer.name``'s AdamW or Muon over the stage's
parameters in their groups (decayed or not; Muon's matrices apart), wrapped to step ZeRO's (or bf16's) fp32
master rows."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from polyshard.dp import DataParallelWrapper, Muon, ZeroOptimizer
from polyshard.mesh import Mesh
from polyshard.models import spec_of
from polyshard.models.spec import decays as default_decays
from polyshard.trainer.config import Config, OptimizerConfig
from polyshard.trainer.engine.layout import keeps_masters

ADAMW_KERNELS: dict[str, dict[str, bool]] = {
    "auto": {},  # torch's own choice (foreach where the tensors allow it)
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "for-loop": {"foreach": False},
}
"""``optimizer.adamw_impl`` -> the keyword arguments of ``torch.optim.AdamW`` (and :class:`polyshard.dp.Muon`)."""


def adamw_kernel(chosen: OptimizerConfig) -> dict[str, bool]:
    """The ``foreach`` / ``fused`` arguments ``optimizer.adamw_impl`` names."""
    return ADAMW_KERNELS[chosen.adamw_impl]


def decay_rule(
    chosen: OptimizerConfig, family: Callable[[str, nn.Parameter], bool]
) -> Callable[[str, nn.Parameter], bool]:
    """Which parameters AdamW decays: the family's rule (``weight_decay_params = "matrices"``) or every one
    (``"all"``, torchtitan's)."""
    return family if chosen.weight_decay_params == "matrices" else _every


def _every(name: str, param: nn.Parameter) -> bool:
    return True


def param_groups(
    named: Iterable[tuple[str, nn.Parameter]],
    weight_decay: float,
    decays: Callable[[str, nn.Parameter], bool] | None = None,
) -> list[dict[str, Any]]:
    """AdamW's two groups: the parameters ``decays`` picks (by model name) and the rest, undecayed.

    ``named``: (model name, parameter) pairs. Model names, not stage-local ones, decide: a
    pipeline's copy of a tied embedding is named as the embedding, and is not decayed either.
    ``decays`` defaults to the usual rule, :func:`polyshard.models.spec.decays`.
    """
    decays = decays or default_decays
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in named:
        if not p.requires_grad:
            continue
        (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def muon_groups(
    named: Iterable[tuple[str, nn.Parameter]],
    weight_decay: float,
    decays: Callable[[str, nn.Parameter], bool],
    orthogonalised: Callable[[str, nn.Parameter], bool],
) -> list[dict[str, Any]]:
    """:class:`polyshard.dp.Muon`'s groups: the matrices ``orthogonalised`` picks (``muon=True``), then
    AdamW's two groups of :func:`param_groups` for the rest. Each Muon matrix is decayed when ``decays``
    says so (the blocks' matrices all are, by the usual rule)."""
    named = [(name, p) for name, p in named if p.requires_grad]
    matrices = [(name, p) for name, p in named if orthogonalised(name, p)]
    chosen = {id(p) for _, p in matrices}
    rest = [(name, p) for name, p in named if id(p) not in chosen]
    muon = [
        {"params": [p for name, p in matrices if decays(name, p) == wanted], "weight_decay": wd, "muon": True}
        for wanted, wd in ((True, weight_decay), (False, 0.0))
    ]
    return muon + param_groups(rest, weight_decay, decays)


def build_optimizer(
    wrapper: DataParallelWrapper, config: Config, names: Mapping[str, str], mesh: Mesh
) -> torch.optim.Optimizer | ZeroOptimizer:
    """The one place the optimizer is chosen: ``optimizer.name``'s AdamW or Muon over the stage's
    parameters (by model ``names``), wrapped to step ZeRO's (or bf16's) fp32 master rows."""
    chosen, spec = config.optimizer, spec_of(config.model)
    named = [(names[n], p) for n, p in wrapper.module.named_parameters()]
    decays, kernel = decay_rule(chosen, spec.decays), adamw_kernel(chosen)
    inner: torch.optim.Optimizer
    if chosen.name == "muon":
        # Muon reads each stepped tensor's placement record (ZeRO's masters carry theirs) and gathers a
        # split matrix over the mesh axes the record names: see polyshard.dp.muon.
        inner = Muon(
            muon_groups(named, chosen.weight_decay, decays, spec.orthogonalised),
            mesh=mesh,
            lr=chosen.lr,
            momentum=chosen.muon_momentum,
            nesterov=chosen.muon_nesterov,
            ns_steps=chosen.muon_ns_steps,
            betas=(chosen.beta1, chosen.beta2),
            **kernel,
        )
    else:
        groups = param_groups(named, chosen.weight_decay, decays)
        inner = torch.optim.AdamW(groups, lr=chosen.lr, betas=(chosen.beta1, chosen.beta2), **kernel)
    if not keeps_masters(config):
        return inner  # gradients are full and averaged in place: a plain optimizer suffices
    return ZeroOptimizer(inner, wrapper)
