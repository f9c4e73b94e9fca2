"""``training.compile``: torch.compile on the trainer's models, one compiled unit per transformer block.

Every :class:`~polyshard.models.common.Block` gets its ``forward`` replaced by ``torch.compile`` of it
(as torchtitan compiles each block). Dynamo keys its cache by code object, and every block runs the same
``Block.forward``, so the first block compiles and the others reuse its graph: compile time does not
grow with depth. Only the forward is compiled, never ``__call__``, so a block's own hooks (ZeRO-3's
gather and free, tp's sequence split) stay outside and run eagerly as before. Hooks on modules inside a
block (tp's attention entry) are traced, and dynamo does not guard on hooks: blocks are compiled after
every strategy has set its hooks, and every block carries the same ones.

Collectives are graph breaks at known places: each is ``torch.compiler.disable``-d where it is defined
(polyshard.collectives' autograd functions, tp's overlapped column matmul, cp's attention, the MoE
layer's dispatch-compute-combine), so a compiled block is compiled pieces between eager collectives;
the tp README says why (measured). Embeddings, heads and losses stay eager.

:class:`~polyshard.trainer.loop.hooks.CompileLog` counts what dynamo did (frames compiled, recompiles,
graph breaks, seconds) into ``metrics.jsonl`` when it changes; with the ``polyshard.trainer.compile``
logger at DEBUG it logs every graph break's reason, and torch's own graph-break and recompile logs
(with their source lines) are switched on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch._dynamo
import torch._functorch.config
from torch import nn
from torch._dynamo.utils import counters, get_compilation_metrics

from polyshard.models.anatomy import transformer_blocks

log = logging.getLogger("polyshard.trainer.compile")


def compile_blocks(modules: Iterable[nn.Module], *, retain_graph: bool = False) -> int:
    """Compile the forward of every transformer block in ``modules``; returns how many.

    Dynamo's caches and counters are reset first: a process that runs several jobs (a test worker)
    starts each with no compiled code and no recompile budget used by another model. ``retain_graph``:
    the backward is split (zero-bubble). W no longer runs a compiled block's backward again (B keeps the
    weight gradients it computed, polyshard.pp.split), but the split's fallback for a weight shared
    inside a stage still runs a whole second backward over the retained graph, and AOTAutograd's donated
    buffers (saved tensors freed into the backward's outputs) would be gone by then: they stay off."""
    torch._dynamo.reset()
    counters.clear()
    torch._functorch.config.donated_buffer = not retain_graph
    if log.isEnabledFor(logging.DEBUG):
        torch._logging.set_logs(graph_breaks=True, recompiles=True)  # type: ignore[attr-defined]
    blocks = [block for module in modules for block in transformer_blocks(module)]
    for block in blocks:
        # The bound method: one code object (Block.forward) for every block, so one cache entry serves all.
        block.forward = torch.compile(block.forward)  # type: ignore[method-assign]
    return len(blocks)


@dataclass(frozen=True)
class CompileStats:
    """What dynamo did in this process since :func:`compile_blocks`."""

    frames: int
    """Frames compiled: each block's forward, the pieces after each graph break, and every recompile."""
    recompiles: int
    """Compiles of a frame that already had compiled code whose guards failed (a new shape, dtype, mode)."""
    graph_breaks: int
    """Graph breaks met while compiling (collectives by design; see the tp README)."""
    compile_s: float
    """Seconds spent compiling (dynamo, AOTAutograd and inductor, cache hits included)."""


def compile_stats() -> CompileStats:
    # The compilation metrics keep the last 64 frames: enough for a run's handful of block graphs.
    metrics = get_compilation_metrics()
    return CompileStats(
        frames=counters["frames"]["ok"],
        recompiles=sum(1 for m in metrics if (m.cache_size or 0) > 0 and m.fail_type is None),
        graph_breaks=sum(counters["graph_break"].values()),
        compile_s=round(sum(m.entire_frame_compile_time_s or 0.0 for m in metrics), 3),
    )


def graph_break_reasons() -> dict[str, int]:
    """Each distinct graph-break reason dynamo met (what ``torch._dynamo.explain`` lists) -> times met."""
    return dict(counters["graph_break"])


def summary() -> str:
    """One line for a run's summary."""
    stats = compile_stats()
    return (
        f"compiled: {stats.frames} frames, {stats.recompiles} recompiles, "
        f"{stats.graph_breaks} graph breaks, {stats.compile_s:.1f} s compiling"
    )
