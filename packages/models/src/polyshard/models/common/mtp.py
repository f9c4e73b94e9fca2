"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2): D extra depths that each predict
one token further ahead, trained beside the next-token loss and dropped (or used to draft) at inference.

Shapes: B rows, S positions, H hidden, D depths. Depth k (1..D) at position i reads

    h_k[i] = Block_k( W_k [ RMSNorm_e(Emb(t[i+k])) ; RMSNorm_h(h_{k-1}[i]) ] )     W_k: (2H -> H)

where h_0 is the last block's output (before the model's final norm) and t[i+k] the input token k places
ahead, then its own final norm and the model's shared output head give logits for t[i+k+1]. The
embedding and the head are the model's own (the caller passes them; a pipeline's last stage holds a
copy of the embedding kept equal like a tied one). The concatenation puts the embedding first, as the
published checkpoints' ``eh_proj`` (embedding then hidden) and Megatron-Core do; the paper writes the
hidden first, which is the same model with W's halves swapped.

Loss: ``L = lambda / D * sum_k L_k``, each ``L_k`` the mean cross-entropy over its counted targets. The
caller passes each microbatch's depth inputs and targets (B, S, D) and loss function to the forward
(:class:`PredictionInputs`); positions whose depth-k target does not exist (the row's last
k positions, or a token k ahead in another document) carry the ignore index. The loss is attached to the
main output by :class:`AttachLoss` (its gradient flows in the main loss's backward), so a pipeline still
passes one tensor and the reported loss stays the next-token one; :attr:`MultiTokenPrediction.loss_sums`
keeps each depth's loss for logging.

A family opts in (the GPT does, so Llama, Qwen and the MoE GPT do): it builds D :class:`PredictionDepth`
around blocks like its own, puts a :class:`MultiTokenPrediction` on its output head's layer as ``mtp``
(whose forward calls it after the head, with the head's input), ties ``mtp.embed.weight`` to its token
embedding (a ``tied`` entry of its spec, so a pipeline's last stage holds a kept-equal copy), adds the
depths' blocks to its tp plan and has a ``mtp_depth`` setting; the trainer finds the module by type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from polyshard.models.common.attach import AttachLoss
from polyshard.models.common.documents import Documents
from polyshard.models.common.mlp import norm_layer

DepthLoss = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""(depth k's outputs as the head gives them, its targets (B, S), k - 1) -> its mean loss."""


@dataclass(frozen=True)
class PredictionInputs:
    """What the depths need beside the model's own input, per microbatch (training only)."""

    inputs: torch.Tensor
    """(B, S, D): token t[i+k] at [:, i, k-1]."""
    targets: torch.Tensor
    """(B, S, D): target t[i+k+1], or the ignore index."""
    loss_fn: DepthLoss


class PredictionDepth(nn.Module):
    """One depth: the two input norms, the (2H -> H) combination, a transformer block and its final norm."""

    def __init__(self, block: nn.Module, hidden: int, norm: str = "rms", norm_eps: float = 1e-5):
        super().__init__()
        self.embed_norm = norm_layer(norm, hidden, norm_eps)  # DeepSeek's enorm
        self.hidden_norm = norm_layer(norm, hidden, norm_eps)  # hnorm
        self.combine = nn.Linear(2 * hidden, hidden, bias=False)  # eh_proj, replicated under tp (like the norms)
        self.block = block
        self.norm = norm_layer(norm, hidden, norm_eps)  # before the shared head (each depth its own, as released)

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        documents: Documents | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        both = torch.cat([self.embed_norm(embedded), self.hidden_norm(hidden)], dim=-1)  # (B, S, 2H)
        return self.block(self.combine(both), documents, positions)  # type: ignore[no-any-return]  # (B, S, H)


class MultiTokenPrediction(nn.Module):
    """D :class:`PredictionDepth` modules and the token embedding they share with the model (``embed``,
    tied to it by the family). Run only when its head is given :class:`PredictionInputs`: otherwise the
    model is the plain one (evaluation, generation). ``weight``: lambda; ``loss_scale``: each
    microbatch's share of the step (1 / microbatches, as the pipeline divides the main loss)."""

    def __init__(self, depths: list[PredictionDepth], vocab_size: int, hidden: int, *, weight: float = 0.3):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.depths = nn.ModuleList(depths)
        self.weight = weight
        self.loss_scale = 1.0
        self.loss_sums: torch.Tensor | None = None  # (D,) each depth's loss summed over the step's microbatches

    def forward(
        self,
        hidden: torch.Tensor,
        output: torch.Tensor,
        head: Callable[[torch.Tensor], torch.Tensor],
        prediction: PredictionInputs,
        documents: Documents | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden``: the last block's output (B, S, H); ``output``: the model's own (logits or normed
        hidden); ``head``: the shared head after a depth's norm; ``documents`` / ``positions``: as the
        model's blocks had them. Returns ``output`` with the weighted MTP loss attached."""
        losses = []
        for k, depth in enumerate(cast(list[PredictionDepth], self.depths)):
            hidden = depth(hidden, self.embed(prediction.inputs[..., k]), documents, positions)
            losses.append(prediction.loss_fn(head(depth.norm(hidden)), prediction.targets[..., k], k))
        stacked = torch.stack(losses)  # (D,)
        done = stacked.detach().double()
        self.loss_sums = done if self.loss_sums is None else self.loss_sums + done
        if not torch.is_grad_enabled():
            return output
        scale = self.weight / len(self.depths) * self.loss_scale
        return AttachLoss.apply(output, stacked.sum(), scale)  # type: ignore[no-untyped-call, no-any-return]

    def take_losses(self) -> torch.Tensor | None:
        """Each depth's loss summed over the microbatches since the last call (None: none ran); resets."""
        sums, self.loss_sums = self.loss_sums, None
        return sums
