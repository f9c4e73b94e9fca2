"""`Muon`: orthogonalised momentum for matrices, AdamW for the rest, on whole matrices whatever the layout.

Muon (Jordan et al. 2024) steps a weight matrix ``W`` (m x n) with gradient ``G``::

    B <- mu B + G                              momentum buffer (the one state tensor)
    U =  G + mu B   (Nesterov)  or  B
    O =  orthogonalise(U)                      ~ U's polar factor, see polyshard.dp.newton_schulz
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(m, n)) O

with Moonlight's scaling (Liu et al. 2025, 2502.16982): the update's RMS matches AdamW's, so
AdamW's learning rate and decoupled weight decay carry over. Parameter groups with ``muon=False``
(embeddings, head, norms, biases, routers) take torch's AdamW step, state and all.

**Whole matrices.** The buffer update is elementwise, so it runs on whatever piece of a matrix this
rank steps (a tp slice, ZeRO rows of it, both). Orthogonalisation is not: it needs the whole matrix.
The placement record of the stepped tensor says which mesh axes split the matrix dims (the last
two; leading dims, e.g. a stack of experts split over ep, are a batch and need nothing). Over those
axes, per matrix: one rank, the *owner*, chosen round-robin so the work is spread::

    gather   every piece to the owner            (a gather on the group of those axes)
    owner    places each piece by its rank's coordinates (record.local_slices), drops padding,
             orthogonalises, cuts the result back into pieces
    scatter  each rank its piece                 (a scatter; both through polyshard.collectives.ops,
                                                 so the byte ledger counts them)

Matrices go one after another, so no rank holds more than one whole matrix (and a few transient
copies of it) at a time. Axes that replicate a matrix (plain dp, kv heads replicated over tp)
compute the same result on each replica, from the same numbers, like AdamW does.

Example: ``fc_in.weight`` (128, 32) under tp=2 (Shard(0)) and ZeRO-1 over dp=2 (Shard(0) of each
tp piece) is split in four row blocks of 32 over the tp x dp group of 4 ranks; the k-th such matrix
of the step is orthogonalised by the group's rank ``k % 4``.

Every rank of a group must step the same matrices in the same order: ranks that differ only along
the splitting axes hold the same pipeline layers and names, so they do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.optim.adamw import adamw

from polyshard.collectives import ops
from polyshard.dp.newton_schulz import orthogonalise, shape_scale
from polyshard.mesh import Mesh, Shard, TensorPlacement, get_placement

MOMENTUM = "momentum_buffer"
"""The state key of a Muon matrix (AdamW's are ``exp_avg``, ``exp_avg_sq`` and ``step``)."""


def matrix_axes(record: TensorPlacement | None) -> tuple[str, ...]:
    """The mesh axes that split a matrix's own dims (its last two), in the record's order: the group a
    matrix is gathered over. The one place this is decided: whichever strategy shards a matrix (tp, ZeRO
    over the data axes or a sub-group of them) says so in the record, and nothing else is consulted."""
    if record is None:
        return ()
    first = len(record.global_shape) - 2
    return tuple(axis for axis, p in record.placements if isinstance(p, Shard) and p.dim >= first)


class Muon(torch.optim.Optimizer):
    """Muon for groups marked ``muon=True`` (every tensor at least 2-D), AdamW for the others.

    ``mesh``: the mesh the placement records name; needed once a record splits a matrix over an axis
    (None: every matrix must be whole on this rank). Group options: ``lr``, ``weight_decay``,
    ``momentum``, ``nesterov``, ``ns_steps`` (Muon) and ``betas``, ``eps`` (AdamW).
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        *,
        mesh: Mesh | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "betas": betas,
            "eps": eps,
            "muon": False,
            "foreach": foreach,  # the AdamW groups' kernel, as torch.optim.AdamW's arguments choose it
            "fused": fused,
        }
        super().__init__(list(params), defaults)
        self.mesh = mesh
        for group in self.param_groups:
            flat = [p for p in group["params"] if group["muon"] and p.dim() < 2]
            if flat:
                raise ValueError(
                    f"a muon=True group holds a tensor of shape {tuple(flat[0].shape)}; Muon steps matrices"
                )
        self._turns: dict[tuple[str, ...], int] = {}

    def orthogonalises(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is in a ``muon=True`` group (its state is a momentum buffer, not AdamW's)."""
        return any(p is param for group in self.param_groups if group["muon"] for p in group["params"])

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]  # no closure: one gradient per step
        self._turns = {}  # the owners of this step's matrices, round-robin from each group's rank 0
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            else:
                _adamw_step(self, group)

    def _muon_step(self, group: dict[str, Any]) -> None:
        mu, lr = group["momentum"], group["lr"]
        for p in group["params"]:
            record = get_placement(p)
            if p.grad is None and not matrix_axes(record):
                continue  # like torch's optimizers: no gradient, no step
            if p.grad is None:
                # Its group still gathers this matrix: take part with zeros, change nothing here.
                self._orthogonalised(torch.zeros_like(p), record, group["ns_steps"])
                continue
            state = self.state[p]
            if MOMENTUM not in state:
                state[MOMENTUM] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buffer = state[MOMENTUM]
            buffer.mul_(mu).add_(p.grad)
            update = p.grad.add(buffer, alpha=mu) if group["nesterov"] else buffer
            ortho = self._orthogonalised(update, record, group["ns_steps"])
            shape = record.global_shape if record is not None else tuple(p.shape)
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(ortho.to(p.dtype), alpha=-lr * shape_scale(shape))

    def _orthogonalised(self, update: torch.Tensor, record: TensorPlacement | None, steps: int) -> torch.Tensor:
        """This rank's piece of the orthogonalised whole matrix (or batch of matrices) ``update`` is part of."""
        axes = matrix_axes(record)
        if record is None:
            return orthogonalise(update, steps)
        if self.mesh is None:
            if axes:
                raise ValueError(f"{record.name} is split over {axes}: give Muon the mesh to gather it")
            return _orthogonalise_tiled(update, record, [tuple(slice(0, s) for s in update.shape[-2:])], steps)[0]
        layout = self.mesh.layout
        members = self.mesh.ranks_in_group(axes) if axes else [self.mesh.rank]
        sizes = layout.as_dict()
        pieces = [record.local_slices(sizes, layout.coords(rank))[-2:] for rank in members]
        if len(members) == 1:
            return _orthogonalise_tiled(update, record, pieces, steps)[0]
        return self._gather_orthogonalise_scatter(self.mesh, update.float().contiguous(), record, axes, pieces, steps)

    def _gather_orthogonalise_scatter(
        self,
        mesh: Mesh,
        piece: torch.Tensor,
        record: TensorPlacement,
        axes: tuple[str, ...],
        pieces: list[tuple[slice, ...]],
        steps: int,
    ) -> torch.Tensor:
        key = mesh.layout.normalize_axes(axes)
        owner = self._turns.get(key, 0) % len(pieces)  # the k-th matrix of the step goes to group rank k % size
        self._turns[key] = self._turns.get(key, 0) + 1
        group = mesh.group(axes)
        gathered = ops.gather_to(piece, owner, group)  # the owner alone receives the whole matrix
        results = _orthogonalise_tiled(gathered, record, pieces, steps) if gathered is not None else None
        out = torch.empty_like(piece)
        ops.scatter_from(out, results, owner, group)
        return out


def _orthogonalise_tiled(
    parts: torch.Tensor | Sequence[torch.Tensor],
    record: TensorPlacement,
    pieces: Sequence[tuple[slice, ...]],
    steps: int,
) -> list[torch.Tensor]:
    """Assemble a matrix from ``parts`` (one per region ``pieces`` of its padded matrix dims), orthogonalise
    the unpadded matrix, and cut the result into the same pieces (padding stays zero)."""
    parts = [parts] if isinstance(parts, torch.Tensor) else list(parts)
    batch = tuple(parts[0].shape[:-2])
    rows, cols = record.global_shape[-2:]
    whole = parts[0].new_zeros((*batch, *record.tiled_shape[-2:]), dtype=torch.float32)
    for (row_slice, col_slice), part in zip(pieces, parts):
        whole[..., row_slice, col_slice] = part
    parts.clear()  # the pieces now live in ``whole`` only
    result = torch.zeros_like(whole)
    result[..., :rows, :cols] = orthogonalise(whole[..., :rows, :cols], steps)
    del whole
    return [result[..., row_slice, col_slice].contiguous() for row_slice, col_slice in pieces]


def _adamw_step(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """torch's AdamW step on ``group``: the same state (``step``, ``exp_avg``, ``exp_avg_sq``) and the same
    kernel choice as ``torch.optim.AdamW`` given the group's ``foreach`` / ``fused``, so the non-matrix parameters
    train exactly as under ``optimizer.name = "adamw"``."""
    params, grads, avgs, squares, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        state = optimizer.state[p]
        if not state:
            # The fused kernel reads the step where the parameter is (torch.optim.AdamW puts it there too).
            on = p.device if group.get("fused") else None
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=on)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        params.append(p)
        grads.append(p.grad)
        avgs.append(state["exp_avg"])
        squares.append(state["exp_avg_sq"])
        steps.append(state["step"])
    if params:
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            avgs,
            squares,
            [],
            steps,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            foreach=group.get("foreach"),
            fused=group.get("fused"),
        )
