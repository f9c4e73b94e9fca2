"""`ZeroOptimizer`: any torch.optim optimizer, stepping only this rank's shard in fp32.

ZeRO stage 1 (Rajbhandari et al., 1910.02054, P_os): optimizer state is kept
only for the rows of each parameter that this rank owns. One step::

    finish_grad_sync            every rank has the averaged gradient of its rows
    master.grad = grad rows     (fp32)
    inner.step()                AdamW (or any optimizer) on the fp32 master rows
    write_params                rows -> parameters; stages 1/2 all-gather them,
                                stage 3 keeps them sharded until the next forward

It wraps a model made by :class:`~polyshard.dp.DataParallel` (any
``zero_stage``; at stage 0 its masters are whole parameters, which is what
mixed precision needs) or :class:`~polyshard.dp.FullyShardedDataParallel`. The
inner optimizer's parameter groups (learning rates, weight decay) are kept;
each parameter is swapped for its fp32 master rows, so its state is sized
for those rows only. Without mixed precision the master rows are views of the
rows the wrapper keeps (the parameter's own storage at stages 0-2, the shard
at stage 3), stepped in place: no copy of the parameters exists, as in the
ZeRO paper's accounting. With mixed precision they are fp32 copies.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from polyshard.dp.errors import GradSyncError, UnownedParameterError
from polyshard.dp.wrapper import DataParallelWrapper
from polyshard.mesh import get_placement, set_placement


class ZeroOptimizer:
    """Wrap ``optimizer`` (built on ``model``'s parameters, not yet stepped) for sharded stepping."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: DataParallelWrapper):
        if optimizer.state:
            raise GradSyncError(
                "the optimizer already has state; wrap it in ZeroOptimizer before its first step "
                "so its state is created for this rank's shard only"
            )
        self.optimizer, self.model = optimizer, model
        owned = {id(p): (name, p) for name, p in model.owned_params()}
        self.masters: dict[int, nn.Parameter] = {}  # id(model param) -> fp32 master rows
        self.params: dict[int, nn.Parameter] = {}  # id(master) -> model param
        # Frozen parameters of the model never get gradients: drop them, as torch optimizers would skip them.
        frozen = {id(p) for p in model.module.parameters() if not p.requires_grad}
        for group in optimizer.param_groups:
            group["params"] = [self._master_for(p, owned) for p in group["params"] if id(p) not in frozen]
        missing = [name for key, (name, _) in owned.items() if key not in self.masters]
        if missing:
            raise UnownedParameterError(
                f"the optimizer does not hold {missing[:3]}{' ...' if len(missing) > 3 else ''}; "
                "build it on model.parameters() (the wrapped model's trainable parameters)"
            )

    def _master_for(self, param: nn.Parameter, owned: dict[int, tuple[str, nn.Parameter]]) -> nn.Parameter:
        if id(param) not in owned:
            raise UnownedParameterError(
                f"the optimizer holds a tensor of shape {tuple(param.shape)} that the data-parallel wrapper "
                "does not manage (frozen, from another model, or added after wrapping); build the optimizer "
                "on the wrapped model's trainable parameters"
            )
        if id(param) in self.masters:
            raise UnownedParameterError(f"{owned[id(param)][0]!r} appears twice in the optimizer's param groups")
        name, _ = owned[id(param)]
        master = nn.Parameter(self.model.master_init(param))
        set_placement(master, self.model.shard_placement(param, name))
        self.masters[id(param)] = master
        self.params[id(master)] = param
        return master

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:
        return self.optimizer.state

    @torch.no_grad()
    def step(self) -> None:
        """Wait for gradients, step the fp32 rows, write the parameters back."""
        self.model.finish_grad_sync()
        for master in self.masters.values():
            grad = self.model.grad_shard(self.params[id(master)])
            master.grad = None if grad is None else grad.to(torch.float32).view_as(master)
        self.optimizer.step()
        self._label_state()
        self.model.write_params(self.masters)

    def _label_state(self) -> None:
        # Exp. averages and the like are shaped like the master rows: give them its placement.
        for master in self.masters.values():
            record = get_placement(master)
            for value in self.optimizer.state.get(master, {}).values():
                if record is not None and isinstance(value, torch.Tensor) and value.shape == master.shape:
                    set_placement(value, record)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)
        for master in self.masters.values():
            master.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()
