"""The mixture-of-experts layer: route, dispatch, run local experts, combine.

Shapes: B batch, S sequence, H hidden, T = B*S tokens on this rank, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from polyshard.collectives import eager
from polyshard.ep import DispatchMeta, combine, dispatch
from polyshard.models.common.moe.config import MoEConfig
from polyshard.models.common.moe.experts import GroupedExperts
from polyshard.models.common.moe.router import Router, tokens_per_expert
from polyshard.models.common.moe.token_group import capacity_keep, router_losses, sequence_loss
from polyshard.models.errors import MoEConfigError


@dataclass(frozen=True)
class MoEMetrics:
    """What one forward did, for logging (plain numbers, no graph)."""

    tokens_per_expert: tuple[int, ...]
    """Assignments this rank's router sent to each of the E experts (before capacity drops)."""
    tokens_per_local_expert: tuple[int, ...]
    """Rows each expert on this rank processed, from every ep rank (after drops)."""
    dropped_assignments: int
    """(token, expert) assignments dropped by the capacity rule on this rank."""
    dropped_tokens: int
    """Tokens of this rank that lost every one of their experts (the layer output is zero for them)."""
    load_balancing_loss: float
    z_loss: float
    sequence_balance_loss: float
    """DeepSeek-V3's sequence-wise balance loss (0 unless seq_aux_loss_coef > 0)."""
    aux_loss: float
    """aux_loss_coef * load_balancing_loss + z_loss_coef * z_loss + seq_aux_loss_coef * sequence_balance_loss."""


class MoELayer(nn.Module):
    """A token-choice top-k mixture of experts (Shazeer et al. 1701.06538; Switch 2101.03961).

    ``forward(x)`` returns ``(y, aux_loss)``: add ``aux_loss`` to the training
    loss. Without expert parallelism the layer holds all E experts; after
    :func:`polyshard.ep.apply_expert_parallel` (which finds it as a :class:`polyshard.ep.ExpertLayer`)
    it holds E/P of them and exchanges tokens with the other ranks of its ep group. Each rank routes,
    applies capacity and computes the auxiliary losses on its own tokens only,
    or, with a ``token_group`` (context parallelism), the losses of the whole
    sequences whose chunks the group's ranks hold.

    ``config``: the ``[model.moe]`` settings (the layer reads the routing, the experts' activation and
    the losses); ``hidden``: the model's width H; ``ffn_hidden``: each expert's width F, when
    ``config.ffn_hidden`` is None (a model passes its default, the MLP width / top_k).
    """

    def __init__(self, config: MoEConfig, *, hidden: int, ffn_hidden: int | None = None):
        super().__init__()
        width = config.ffn_hidden or ffn_hidden
        for name, value in (("hidden", hidden), ("ffn_hidden", width)):
            if not isinstance(value, int) or value < 1:
                raise MoEConfigError(
                    f"MoELayer {name}={value!r} must be a positive integer"
                    + (" (set model.moe.ffn_hidden or pass ffn_hidden=)" if name == "ffn_hidden" else "")
                )
        assert width is not None  # checked above
        self.config = config
        self.hidden, self.ffn_hidden = hidden, width
        self.router = Router(
            hidden,
            config.num_experts,
            config.top_k,
            config.renormalize,
            score=config.score,
            groups=config.groups,
            group_topk=config.group_topk,
            scale=config.scale,
            router_bias=config.router_bias,
        )
        self.experts = GroupedExperts(
            config.num_experts,
            hidden,
            width,
            config.activation,
            bias=config.expert_bias,
            alpha=config.swiglu_alpha,
            limit=config.swiglu_limit,
        )
        self.ep_group: dist.ProcessGroup | None = None  # set by apply_expert_parallel
        self.token_group: dist.ProcessGroup | None = None
        """Ranks holding other parts of this rank's sequences (cp), set by
        :func:`polyshard.ep.share_routing_statistics`: the auxiliary losses are then the whole batch's
        (:mod:`.token_group`); None: this rank's own."""
        self.loss_sharers = 1
        """How many ranks of ``token_group`` hold one copy of the loss between them: its tp ranks under
        sequence parallelism (a trainer sums their gradients instead of averaging them), 1 for cp
        alone. The backward of the group's statistics is divided by it (:mod:`.token_group`)."""
        self.positions: torch.Tensor | None = None
        """(S_local,) sequence positions of this rank's tokens in the token group's batch (the order the
        capacity rule serves tokens in), set with ``token_group``."""
        self.last_metrics: MoEMetrics | None = None
        self.rows_seen: torch.Tensor | None = None
        """(E_local,) rows each local expert processed in the training forwards since
        :meth:`take_rows_seen` (from every ep rank, after capacity drops): an expert at 0
        took no part in the step, and a trainer can leave it exactly as it was."""
        self.load_seen: torch.Tensor | None = None
        """(E + 2,) int64 over the training forwards since :meth:`take_load`, this rank's tokens only:
        the assignments its router chose for each of the E experts (before capacity drops: the load
        that balancing acts on), then the tokens that lost every expert, then the tokens routed."""

    @property
    def num_experts(self) -> int:
        """Experts E over every ep rank (:attr:`experts` holds E/P of them once expert-parallel)."""
        return self.config.num_experts

    @property
    def capacity_factor(self) -> float | None:
        return self.config.capacity_factor

    # Eager under torch.compile (a graph break): the dispatch's split sizes change every step and are read
    # as Python ints (all_to_all, the experts' grouped matmul, the metrics); compiled they would force a
    # recompile per step. The attention and norms of an MoE block still compile.
    @eager
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., H) -> ((..., H), scalar aux loss). The sequence-wise loss reads (B, S, H) as B sequences."""
        cfg = self.config
        tokens = x.reshape(-1, self.hidden)  # (T, H)
        routing = self.router(tokens)
        keep = None
        if cfg.capacity_factor is not None:  # (T, k); over the token group's whole batch when there is one
            keep = capacity_keep(
                routing.experts, cfg.num_experts, cfg.capacity_factor, self.token_group, self.positions
            )

        expert_input, meta = dispatch(tokens, routing.experts, cfg.num_experts, self.ep_group, keep)  # (N, H)
        expert_output = self.experts(expert_input, meta.tokens_per_local_expert)  # (N, H)
        if torch.is_grad_enabled():  # training forwards only (not evaluation, nor shape inference)
            rows = torch.tensor(meta.tokens_per_local_expert, dtype=torch.int64)
            self.rows_seen = rows if self.rows_seen is None else self.rows_seen + rows
        if _training_forward():
            load = _load(routing.experts, keep, cfg.num_experts)
            self.load_seen = load if self.load_seen is None else self.load_seen + load
        y = combine(expert_output, routing.weights, meta)  # (T, H)

        balance, router_z = router_losses(
            routing, cfg.num_experts, self.token_group, cfg.z_loss_coef > 0, self.loss_sharers
        )
        aux = cfg.aux_loss_coef * balance + cfg.z_loss_coef * router_z
        seq_balance = torch.zeros((), device=x.device)
        if cfg.seq_aux_loss_coef > 0:
            sequence = x.shape[-2] if x.dim() >= 3 else tokens.shape[0]  # (B, S, H): B sequences of S tokens
            seq_balance = sequence_loss(routing, cfg.num_experts, sequence, self.token_group, self.loss_sharers)
            aux = aux + cfg.seq_aux_loss_coef * seq_balance
        losses = (balance, router_z, seq_balance, aux)
        self.last_metrics = _metrics(routing.experts, keep, cfg.num_experts, meta, losses)
        return y.view(x.shape), aux

    def take_rows_seen(self) -> torch.Tensor:
        """The rows each local expert processed since the last call (zeros if none), and reset."""
        seen = (
            self.rows_seen if self.rows_seen is not None else torch.zeros(self.experts.num_experts, dtype=torch.int64)
        )
        self.rows_seen = None
        return seen

    def take_load(self) -> torch.Tensor:
        """:attr:`load_seen` since the last call (zeros if none), and reset."""
        load = (
            self.load_seen
            if self.load_seen is not None
            else torch.zeros(self.config.num_experts + 2, dtype=torch.int64)
        )
        self.load_seen = None
        return load


def _training_forward() -> bool:
    """A forward with gradients that is not activation checkpointing's recompute inside backward, so
    each token is counted once however the block is checkpointed."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def _load(experts: torch.Tensor, keep: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """(E + 2,) int64 on the CPU: assignments per expert, tokens that lost every expert, tokens."""
    dropped = 0 if keep is None else int((~keep.any(dim=1)).sum())
    counts = tokens_per_expert(experts, num_experts).cpu()
    return torch.cat([counts, torch.tensor([dropped, experts.shape[0]], dtype=torch.int64)])


def _metrics(
    experts: torch.Tensor,
    keep: torch.Tensor | None,
    num_experts: int,
    meta: DispatchMeta,
    losses: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> MoEMetrics:
    balance, router_z, seq_balance, aux = losses
    dropped = 0 if keep is None else int((~keep).sum())
    dropped_tokens = 0 if keep is None else int((~keep.any(dim=1)).sum())
    return MoEMetrics(
        tokens_per_expert=tuple(tokens_per_expert(experts, num_experts).tolist()),
        tokens_per_local_expert=meta.tokens_per_local_expert,
        dropped_assignments=dropped,
        dropped_tokens=dropped_tokens,
        load_balancing_loss=float(balance.detach()),
        z_loss=float(router_z.detach()),
        sequence_balance_loss=float(seq_balance.detach()),
        aux_loss=float(aux.detach()),
    )


def moe_metrics(model: nn.Module) -> dict[str, MoEMetrics]:
    """The last forward's metrics of every MoE layer in ``model``, by module name (for a trainer's log)."""
    return {name: m.last_metrics for name, m in model.named_modules() if isinstance(m, MoELayer) and m.last_metrics}
