"""Context parallelism on the trainer's models: each sequence split over the cp ranks.

:mod:`polyshard.cp` does the attention; this module puts it in place on the layers a rank builds:

* every :class:`~polyshard.models.common.Attention` gets a :class:`ContextParallelCore` instead of
  its ``CoreAttention`` (ring or all-gather attention over the cp group), or for Ulysses an
  :class:`UlyssesCore` that keeps the model's own core and runs it on whole sequences of the heads
  the all-to-all hands this rank (over a ring for the 2-D scheme);
* the global positions of this rank's tokens (:func:`polyshard.cp.position_ids`) reach the attentions'
  rotary embeddings and the token embedding's learned position table (GPT-2) with every step, as the
  ``positions`` argument (the engine's ``positions``, a side input of every stage forward);
* :func:`local_tokens` keeps this rank's two load-balanced chunks of a batch's inputs and targets
  (chunks r and 2 cp - 1 - r of 2 cp): every cp rank reads the same examples.

Nothing else changes: blocks, norms and MLPs act on each token alone, the loss is a sum over
tokens (divided by the global count, :mod:`polyshard.trainer.tasks.loss`), and the parameters are
replicated over cp, so their gradients average over dp x ep x cp like any replica's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from polyshard.cp import context_parallel_attention, ring_attention, shard_sequence, ulysses_attention
from polyshard.models.anatomy import attention_layers
from polyshard.models.common import CoreAttention


class ContextParallelCore(nn.Module):
    """``CoreAttention`` for q, k, v holding this rank's chunks of the sequence (B, N, 2C, D)."""

    def __init__(self, group: dist.ProcessGroup, *, causal: bool, style: str, window: int | None = None):
        super().__init__()
        self.group, self.causal, self.style, self.window = group, causal, style, window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``segments`` (B, 2C): this rank's chunks of the rows' document ids (document masking);
        ``sinks`` (N,): the attention's sink logits for this rank's heads."""
        return context_parallel_attention(
            q,
            k,
            v,
            self.group,
            causal=self.causal,
            style=self.style,  # type: ignore[arg-type]
            segments=segments,
            window=self.window,
            sinks=sinks,
        )

    def extra_repr(self) -> str:
        return f"style={self.style}, causal={self.causal}, window={self.window}, cp={dist.get_world_size(self.group)}"


class UlyssesCore(nn.Module):
    """The model's own core on this rank's heads of the whole sequence: all-to-alls over ``group`` turn
    the (B, N, 2C, D) sequence chunks into (B, N/u, S, D) head shards and back (polyshard.cp.ulysses).
    With ``ring_group`` (the 2-D scheme) the sequence the all-to-all gathers is still this ring rank's
    two chunks, and ring attention over ``ring_group`` takes the core's place."""

    def __init__(self, group: dist.ProcessGroup, inner: CoreAttention, ring_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.group, self.inner, self.ring_group = group, inner, ring_group

    def _ring(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        return ring_attention(q, k, v, self.ring_group, self.inner.causal, scale, segments, self.inner.window, sinks)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As :class:`ContextParallelCore`; the inner core applies its own window, ``sinks`` the heads'."""
        core = self.inner if self.ring_group is None else self._ring
        return ulysses_attention(q, k, v, self.group, core, segments, sinks)

    def extra_repr(self) -> str:
        ring = "" if self.ring_group is None else f", ring={dist.get_world_size(self.ring_group)}"
        return f"ulysses={dist.get_world_size(self.group)}{ring}"


def apply_context_parallel(
    model: nn.Module,
    group: dist.ProcessGroup,
    style: str,
    *,
    ulysses_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
) -> None:
    """Swap every attention's inner product for the cp one. The positions of this rank's chunks
    (:func:`polyshard.cp.position_ids`) reach the embedding and the attentions with every step, as an
    argument (the engine's ``positions``). ``ulysses_groups``: this rank's (all-to-all group, ring group)
    for style 'ulysses+ring'."""
    for module, core in attention_layers(model):  # the cores these modules take (q, k, v) through
        if style == "ulysses":
            module.core = UlyssesCore(group, core)
        elif style == "ulysses+ring":
            assert ulysses_groups is not None  # build_engine makes them for this style
            module.core = UlyssesCore(ulysses_groups[0], core, ring_group=ulysses_groups[1])
        else:
            module.core = ContextParallelCore(group, causal=core.causal, style=style, window=core.window)


def local_tokens(tokens: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's chunks of a (B, S, ...) batch along the sequence (all of it without cp)."""
    if group is None:
        return tokens
    return shard_sequence(tokens, 1, group).contiguous()
