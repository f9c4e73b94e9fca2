"""Document masking on this rank's stages: each microbatch's documents reach every attention call.

With ``data.document_mask`` a loader batch carries ``segments`` beside its tokens: each token's document
index within its row (:mod:`polyshard.trainer.tasks` cuts the inputs' part). Every rank builds
its own loader batch, so every pipeline stage has the documents of every microbatch without receiving
them: nothing new travels between stages. The pipeline executor passes microbatch k's :class:`Documents`
to each stage forward on it (a side input: :mod:`polyshard.pp.stage`), and the stage hands them to its
embedding, blocks and head as an argument.

The positions within documents are computed from whole rows before context parallelism cuts them (a
document may start in another rank's chunk); then ids and positions are cut into this rank's chunks,
like the tokens. A block hands its documents to its recompute (activation checkpointing) with its
input, and backward (split or not) walks the graph built by the forward, so whichever schedule runs,
each microbatch is masked with its own documents.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from polyshard.models.common import Documents, document_positions


def documents_of(segments: torch.Tensor, local: Callable[[torch.Tensor], torch.Tensor]) -> Documents:
    """Whole rows' document ids (B, S) -> this rank's :class:`Documents` (``local`` cuts the sequence)."""
    return Documents(local(segments), local(document_positions(segments)))


def microbatch_documents(documents: Documents, num_microbatches: int) -> list[Documents]:
    """Each microbatch's documents: the executor's microbatch k is chunk k of the batch along dim 0."""
    parts = zip(documents.segments.chunk(num_microbatches), documents.positions.chunk(num_microbatches))
    return [Documents(segments, positions) for segments, positions in parts]
