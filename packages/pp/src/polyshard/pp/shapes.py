"""Shape inference before the first step: which tensor shapes travel between stages.

Receivers need buffers of the right shape. Stage 0 runs on a real microbatch,
then each stage tells the next one the shape and dtype of its output (a small
int64 header); the next stage runs itself on zeros of that shape to learn its
own output shape. A failure in any stage's forward is reported to every rank
(an all-reduce of the failing rank), so none waits forever: the failing rank
raises its own error, with a note naming the stage, its input shape and the
action; the others raise :class:`StageShapeError` pointing at it. A stage
output the header cannot carry (not one tensor, another dtype) is itself a
:class:`StageShapeError`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import ops, p2p
from polyshard.pp.actions import Schedule
from polyshard.pp.errors import StageShapeError

DTYPES = p2p.DTYPES  # one table of the dtypes a header can announce
MAX_DIMS = p2p.MAX_DIMS
Meta = tuple[tuple[int, ...], torch.dtype]


def _header(meta: Meta | None, device: torch.device) -> torch.Tensor:
    header = torch.zeros(3 + MAX_DIMS, dtype=torch.int64)  # [ok, dtype, ndim, dims...]
    if meta is not None:
        shape, dtype = meta
        header[0], header[1], header[2] = 1, DTYPES.index(dtype), len(shape)
        header[3 : 3 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    return header.to(device)  # NCCL sends only device tensors


def _checked_meta(y: object, stage: int) -> Meta:
    """The (shape, dtype) a stage sends on, if the header can describe it."""
    if not isinstance(y, torch.Tensor):
        raise StageShapeError(f"stage {stage} returned {type(y).__name__}; a pipeline stage must return one tensor")
    if y.dtype not in DTYPES or y.dim() > MAX_DIMS:
        raise StageShapeError(
            f"stage {stage} returned {y.dtype} with {y.dim()} dims; "
            f"stages may pass {DTYPES} with at most {MAX_DIMS} dims"
        )
    return tuple(y.shape), y.dtype


def _meta(header: torch.Tensor) -> Meta | None:
    values = header.tolist()
    if not values[0]:
        return None
    return tuple(values[3 : 3 + values[2]]), DTYPES[values[1]]


def infer_shapes(
    stages: Mapping[int, nn.Module],
    schedule: Schedule,
    first_microbatch: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    peers: list[int],
    device: torch.device,
) -> dict[int, tuple[Meta, Meta]]:
    """(input meta, output meta) for each of this rank's stages, in stage order along the chain."""
    rank = dist.get_rank(group)
    found: dict[int, tuple[Meta, Meta]] = {}
    failure: Exception | None = None
    upstream: Meta | None = None
    for stage in range(schedule.num_stages):
        owner = schedule.rank_of(stage)
        prev_owner = schedule.rank_of(stage - 1) if stage > 0 else owner
        if owner != rank:
            continue
        if stage == 0:
            if first_microbatch is None:
                raise StageShapeError(f"rank {rank} holds stage 0: shape inference needs the first microbatch")
            upstream = (tuple(first_microbatch.shape), first_microbatch.dtype)
        elif prev_owner != rank:
            upstream = _meta(p2p.recv(_header(None, device), peers[prev_owner], group))
        out_meta = None
        if upstream is not None:
            try:
                x = first_microbatch if stage == 0 else torch.zeros(upstream[0], dtype=upstream[1], device=device)
                # fork_rng: this extra forward must not move the generator dropout draws from, or a
                # resumed run (which infers shapes again) would draw other masks than an uninterrupted one.
                with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type != "cpu" else []):
                    y = stages[stage](x)
                out_meta = _checked_meta(y, stage)
                found[stage] = (upstream, out_meta)
            except StageShapeError as err:
                failure = err
            except Exception as err:  # any failure here must reach every rank, or the others wait forever
                # Raised as what it is (a bug in a layer is not a shape error); the note says where.
                where = f"rank {rank}, action {stage}F0 (the pipeline's first forward, which infers shapes)"
                if stage > 0:
                    where += (
                        f", on the output of stage {stage - 1} (shape {upstream[0]}, {upstream[1]}); if the "
                        f"shapes disagree, make stage {stage}'s first layer accept that shape or change "
                        f"stage {stage - 1}'s last layer"
                    )
                _add_note(err, f"raised in stage {stage} at {where}")
                failure = err
        next_owner = schedule.rank_of(stage + 1) if stage + 1 < schedule.num_stages else rank
        if next_owner != rank:
            p2p.send(_header(out_meta, device), peers[next_owner], group)
        upstream = out_meta
    _raise_if_any_failed(failure, group, device)
    return found


def _add_note(err: BaseException, note: str) -> None:
    if hasattr(err, "add_note"):  # Python >= 3.11 prints notes under the traceback
        err.add_note(note)
    else:  # 3.10 keeps them where 3.11 would, unprinted
        err.__notes__ = [*getattr(err, "__notes__", []), note]


def _raise_if_any_failed(failure: Exception | None, group: dist.ProcessGroup | None, device: torch.device) -> None:
    flag = torch.tensor([dist.get_rank(group) + 1 if failure else 0], dtype=torch.int64, device=device)
    ops.all_reduce(flag, group, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if flag.item():
        raise StageShapeError(
            f"pipeline rank {int(flag.item()) - 1} failed in its stage's first forward (shape inference); "
            "its own error says why"
        )
