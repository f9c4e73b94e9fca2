"""Document masking on this rank's stages: each microbatch's documents reach every attention call.

With ``data.document_mask`` a loader batch carries ``segments`` beside its tokens: each token's document
index within its row (:mod:`polyshard.trainer.tasks` cuts the inputs' part). Every rank builds
its own loader batch, so every pipeline stage has the documents of every microbatch without receiving
them: nothing new travels between stages. Around each forward of stage s on microbatch k the pipeline
executor enters :meth:`StageDocuments.around_forward`, which sets microbatch k's :class:`Documents` on
the stage's blocks and embedding (``block.documents``, ``embedding.documents``) and clears them after.

The positions within documents are computed from whole rows before context parallelism cuts them (a
document may start in another rank's chunk); then ids and positions are cut into this rank's chunks,
like the tokens. A block reads its documents once per forward and hands them to its recompute
(activation checkpointing) itself, and backward (split or not) walks the graph built by the forward,
so whichever schedule runs, each microbatch is masked with its own documents.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from polyshard.models.common import Block, Documents, document_positions
from polyshard.models.gpt import Embedding


def documents_of(segments: torch.Tensor, local: Callable[[torch.Tensor], torch.Tensor]) -> Documents:
    """Whole rows' document ids (B, S) -> this rank's :class:`Documents` (``local`` cuts the sequence)."""
    return Documents(local(segments), local(document_positions(segments)))


class StageDocuments:
    """The documents of each microbatch of a batch, set on a stage's modules around its forwards."""

    def __init__(self, stages: Mapping[int, nn.Module], documents: Documents, num_microbatches: int):
        self.modules = {
            index: [m for m in stage.modules() if isinstance(m, Block | Embedding)] for index, stage in stages.items()
        }
        # the executor's microbatch k is chunk k of the batch along dim 0; so are its documents
        segments, positions = documents.segments, documents.positions
        self.parts = list(zip(segments.chunk(num_microbatches), positions.chunk(num_microbatches)))

    @contextlib.contextmanager
    def around_forward(self, stage: int, microbatch: int) -> Iterator[None]:
        modules = self.modules[stage]
        for module in modules:
            module.documents = Documents(*self.parts[microbatch])
        try:
            yield
        finally:
            for module in modules:
                module.documents = None
