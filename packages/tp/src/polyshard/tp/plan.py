"""``parallelize(model, *, tp_group, plan)``: make a plain PyTorch model tensor parallel.

The plan maps module-name patterns (``fnmatch``: ``blocks.*.attn.q_proj``) to
styles. Converting styles replace matching ``nn.Linear``/``nn.Embedding``
modules in place, slicing their existing full weights, so the model and its
tp version start from identical numbers; the other styles add hooks, flag
parameters or adjust head counts. A pattern maps to one style or a list of
them. A pre-norm transformer block, Megatron style, with sequence parallelism (drop ``sequence_parallel=True``
and the ``SequenceParallel()`` lines for plain tensor parallelism)::

    sp = dict(sequence_parallel=True)
    plan = {
        "blocks.*.norm*": SequenceParallel(),                   # norms run on a sequence shard
        "blocks.*.attn": [TPEntry(**sp), ShardHeads()],         # one entry for q, k and v
        "blocks.*.attn.[qkv]_proj": ColumnParallel(input_entered=True),
        "blocks.*.attn.o_proj": RowParallel(**sp),
        "blocks.*.mlp.fc_in": ColumnParallel(**sp),
        "blocks.*.mlp.fc_out": RowParallel(**sp),
    }
    parallelize(model, tp_group=mesh.group("tp"), plan=plan)
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

import torch.distributed as dist
from torch import nn

from polyshard.mesh import Replicate, TensorPlacement, get_placement, set_placement
from polyshard.tp.errors import PlanError
from polyshard.tp.shard import record_replicate, tp_size
from polyshard.tp.styles import Style

_MAX_LISTED = 30

Plan = Mapping[str, Style | list[Style] | tuple[Style, ...]]
"""Module-name pattern -> the style, or the styles in order, to apply to the modules it matches."""


def _resolve(model: nn.Module, plan: Plan) -> list[tuple[str, nn.Module, Style]]:
    """(module name, module, style) for every match, in plan order; unmatched patterns are errors."""
    modules = dict(model.named_modules())
    modules.pop("", None)
    work: list[tuple[str, nn.Module, Style]] = []
    claimed: dict[str, str] = {}
    for pattern, styles in plan.items():
        for style in _styles(styles):
            if not isinstance(style, Style):
                raise PlanError(f"plan[{pattern!r}] holds {style!r}, which is not a tp style such as ColumnParallel()")
            names = [n for n in modules if fnmatch.fnmatchcase(n, pattern)]
            if not names:
                candidates = [n for n, m in modules.items() if style.accepts(m)] or list(modules)
                shown = ", ".join(candidates[:_MAX_LISTED]) + (" ..." if len(candidates) > _MAX_LISTED else "")
                raise PlanError(f"plan pattern {pattern!r} ({style}) matches no module; candidates: {shown}")
            for name in names:
                if style.replaces and name in claimed:
                    raise PlanError(f"module {name!r} is converted by two patterns: {claimed[name]!r} and {pattern!r}")
                if style.replaces:
                    claimed[name] = pattern
                work.append((name, modules[name], style))
    return work


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _styles(styles: Style | list[Style] | tuple[Style, ...]) -> list[Style]:
    return list(styles) if isinstance(styles, (list, tuple)) else [styles]


def _check_shared(
    model: nn.Module, work: list[tuple[str, nn.Module, Style]], tp: int
) -> dict[int, list[tuple[str, str]]]:
    """Parameters that several modules share (a tied embedding and output head), by ``id``:
    the (module name, parameter name) of each user. A shared parameter stays one parameter
    only if every user is converted with the same layout; anything else would silently untie it."""
    users: dict[int, list[tuple[str, str]]] = {}
    tensors: dict[int, nn.Parameter] = {}
    for full_name, param in model.named_parameters(remove_duplicate=False):
        module, _, attr = full_name.rpartition(".")
        users.setdefault(id(param), []).append((module, attr))
        tensors[id(param)] = param
    converting = {name: style for name, _, style in work if style.replaces}
    shared = {key: where for key, where in users.items() if len(where) > 1}
    for key, where in shared.items():
        names = [f"{m}.{a}" for m, a in where]
        converted = [(m, a) for m, a in where if m in converting]
        if not converted:
            continue
        if len(converted) != len(where):
            left = [f"{m}.{a}" for m, a in where if m not in converting]
            raise PlanError(
                f"{names} are one shared parameter, but the plan converts only some of its users; "
                f"add a style for {left} (e.g. VocabParallel() for a tied embedding and head) or untie them"
            )
        shape = tuple(tensors[key].shape)
        layouts = {converting[m].param_placement(a, shape, tp) for m, a in converted}
        if len(layouts) > 1:
            raise PlanError(
                f"{names} are one shared parameter, but the plan splits it differently in each user "
                f"({', '.join(str(converting[m]) for m, _ in converted)}); use one style (VocabParallel() for "
                "a tied embedding and head) so every user holds the same shard"
            )
    return shared


def planned_placement(plan: Plan, name: str, shape: tuple[int, ...], tp: int, axis: str = "tp") -> TensorPlacement:
    """The record :func:`parallelize` with ``plan`` gives the parameter ``name`` (full ``shape``) on
    ``tp`` ranks, computed from names alone: no model, no process group. Checkpoint resharding uses
    it to lay out a checkpoint for a tp size nobody has trained on yet."""
    module, _, param = name.rpartition(".")
    for pattern, styles in plan.items():
        for style in _styles(styles):
            if not fnmatch.fnmatchcase(module, pattern):
                continue
            placement, padded = style.param_placement(param, tuple(shape), tp)
            # A converting style lays out all its module's parameters; another only those it splits.
            if style.replaces or placement != Replicate():
                return TensorPlacement(name, tuple(shape), ((axis, placement),), padded_shape=padded)
    return TensorPlacement(name, tuple(shape), ((axis, Replicate()),))


def name_placements(model: nn.Module, axis: str = "tp") -> None:
    """Give every parameter a record under its full name: converted ones keep their Shard,
    all others are recorded as replicated over ``axis``."""
    for name, param in model.named_parameters():
        record = get_placement(param)
        if record is None or dict(record.placements).get(axis) is None:
            record_replicate(param, name, axis)
            record = get_placement(param)
        assert record is not None  # record_replicate just set it
        set_placement(param, dataclasses.replace(record, name=name))


def parallelize(model: nn.Module, *, tp_group: dist.ProcessGroup | None, plan: Plan, axis: str = "tp") -> nn.Module:
    """Apply ``plan`` to ``model`` in place over ``tp_group`` and return it.

    Every style is checked against every match before anything changes, so a
    bad plan leaves the model untouched. Afterwards every parameter carries a
    placement record (Shard over ``axis`` or Replicate) named by its full name.
    Call on every rank of the group with the same (same-seed) model.
    """
    tp = tp_size(tp_group)
    work = _resolve(model, plan)
    for name, module, style in work:
        style.check(module, name, tp)
    shared = _check_shared(model, work, tp)
    # A converted module slices its own copy of each weight; users of one shared weight must end up
    # holding one parameter again (the first user's shard), or a tied pair would silently untie.
    shard_of: dict[tuple[str, str], int] = {user: key for key, where in shared.items() for user in where}
    new_shared: dict[int, nn.Parameter] = {}
    for name, module, style in work:
        new = style.apply(module, name, tp_group, axis)
        if new is not module:
            for attr, param in list(new.named_parameters(recurse=False)):
                key = shard_of.get((name, attr))
                if key is not None:
                    setattr(new, attr, new_shared.setdefault(key, param))
            _replace(model, name, new)
    name_placements(model, axis)
    return model
