"""Whole tensors from every rank's pieces, for parity tests that compare every gradient and parameter.

A worker returns this rank's pieces, each ``(global name, local tensor, placement record or None)``, beside
its coordinates (:func:`where`); the test process calls :func:`assemble` on every rank's result. The records
are the ones checkpoints save, so a piece lands where tp, ep and ZeRO put it, padding dropped.

    def _worker(config):
        ...                                  # train with the engine
        return {**where(mesh), "params": parameter_pieces(engine)}

    whole = assemble(distributed.run(4, _worker, config), "params")   # name -> whole tensor
"""

from __future__ import annotations

import dataclasses

import torch

from polyshard.mesh import Mesh, TensorPlacement, get_placement

Piece = tuple[str, torch.Tensor, TensorPlacement | None]


def where(mesh: Mesh) -> dict[str, dict[str, int]]:
    """This rank's coordinate and the size of every mesh axis (a split dp's parts included)."""
    coords = mesh.coords()
    return {"coords": coords, "sizes": {axis: mesh.size(axis) for axis in coords}}


def gradient_pieces(engine) -> list[Piece]:
    """The reduced gradients the optimizer reads (call after ``finish_gradients``, before ``zero_grad``,
    e.g. from train_step's ``before_zero_grad``): whole over dp, or this rank's rows under ZeRO."""
    return [(record.name, grad.detach().clone(), record) for grad, record in engine.gradients()[0]]


def parameter_pieces(engine) -> list[Piece]:
    """Every parameter this rank holds, whole over dp: ZeRO-3's rows are gathered (a collective over the
    dp group, so every rank calls it), so the record keeps only how tp and ep split it."""
    pieces = []
    for index, stage in engine.stages.items():
        names = engine.global_names(index)
        if engine.config.parallel.zero_stage == 3:
            # ZeRO-3 shards every floating parameter, LoRA's frozen base too: gather them (an integer one
            # would stay whole on each rank)
            full = {n: p.detach() for n, p in stage.named_parameters()} | engine.wrappers[index].full_parameters()
        else:
            full = {n: p.detach() for n, p in stage.named_parameters()}
        for n, p in stage.named_parameters():
            record = get_placement(p)
            if record is not None:
                record = dataclasses.replace(record, placements=tuple(x for x in record.placements if x[0] != "dp"))
            pieces.append((names[n], full[n].clone(), record))
    return pieces


def buffer_pieces(engine) -> list[Piece]:
    """The saved buffers (a sigmoid router's selection bias, which the global load moves after each step),
    under the model's names; replicated on every rank that holds their layer."""
    pieces = []
    for index, stage in engine.stages.items():
        saved = stage.state_dict(keep_vars=True)
        for n, b in stage.named_buffers():
            if n in saved:
                local, _, rest = n.partition(".")
                name = f"layers.{engine.layer_ids[index][int(local)]}.{rest}"
                pieces.append((name, b.detach().clone(), get_placement(b)))
    return pieces


def assemble(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Whole tensors by name from ``result[key]`` of every rank: each piece is written where its record's
    ``local_slices`` say (flat ZeRO rows reshaped to them), then the padding past the global shape is
    dropped. Replicas (over dp, tp, cp, a tied weight's copies) must be equal bit for bit: the same reduced
    gradient and the same update on each. Starts from NaN, so a piece no rank sent shows in any comparison."""
    whole: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for result in results:
        sizes, coords = result["sizes"], result["coords"]
        for name, value, record in result[key]:
            shape = value.shape if record is None else record.tiled_shape
            tensor = whole.setdefault(name, torch.full(shape, float("nan"), dtype=value.dtype))
            slices = () if record is None else record.local_slices(sizes, coords)
            piece = value if record is None else value.reshape(record.local_shape(sizes))
            held = tensor[slices]
            seen = ~held.isnan()
            assert torch.equal(held[seen], piece[seen]), f"{key} {name}: replicas differ at {coords}"
            tensor[slices] = piece
            if record is not None:
                shapes[name] = record.global_shape
    return {n: t[tuple(slice(0, s) for s in shapes[n])] if n in shapes else t for n, t in whole.items()}
