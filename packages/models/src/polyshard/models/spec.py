"""A model family, declared in one place: how to build it and everything the trainer asks of it.

The trainer, the pipeline split, resharding, export and ``--dry-run`` never branch on
``model.kind``; they ask the family's :class:`ModelSpec` (torchtitan's ``TrainSpec`` is the same
idea). A new family is one folder that defines its config, modules and a ``SPEC``, plus one line in
:mod:`polyshard.models.registry` (or :func:`polyshard.models.register` from outside).

What a spec must keep true:

* ``build`` returns a module whose ``layers`` is its ordered pipeline layers (the first takes the
  batch's inputs, the last gives the loss's outputs), each mapping one tensor to the next, and
  whose parameters are named ``layers.<i>.…``; it is called under the meta device and must not
  initialise anything (``init`` does, layer by layer, from each layer's own generator).
* ``tp_plan`` names parameters by those global names (see :mod:`polyshard.tp.plan`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from polyshard.mesh import divisors
from polyshard.models.common.initialise import init_weights
from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError
from polyshard.models.hf_adapter import HFAdapter
from polyshard.models.shape import ModelShape, plain_shape
from polyshard.tp import (
    ColumnParallel,
    HeadNorm,
    HeadParameter,
    ReplicateKVHeads,
    RowParallel,
    SequenceParallel,
    ShardHeads,
    SplitSequence,
    TPEntry,
    replicates_kv,
)


class ParallelSizes(Protocol):
    """What a family's plan and checks read of the layout (the trainer's ``[parallel]`` section is one)."""

    @property
    def dp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def ep(self) -> int: ...
    @property
    def cp(self) -> int: ...
    @property
    def zero_stage(self) -> int: ...
    @property
    def sequence_parallel(self) -> bool: ...


@dataclass(frozen=True)
class BuildOptions:
    checkpoint_activations: bool | str = False
    """Blocks recompute their insides in backward: "full" (or True), "selective", or False."""
    aux_loss_scale: float = 1.0
    """The gradient of an MoE layer's aux loss (1 / microbatches when a step accumulates several)."""
    head_logits: bool = True
    """A language model's head projects to the vocabulary; False: it returns its normed hidden states
    and the loss projects them, chunk by chunk (``training.loss_chunks``)."""
    mtp_loss_weight: float = 0.3
    """lambda of the multi-token prediction loss (``training.mtp_loss_weight``; used when model.mtp_depth > 0)."""


def _no_ties(model: ModelConfig) -> dict[str, str]:
    return {}


def _no_checks(model: ModelConfig, parallel: ParallelSizes) -> None:
    return None


def _no_sequence(model: ModelConfig) -> int:
    raise ConfigError(f"model.kind={model.kind!r} declares no sequence length or output width (its spec)")


def decays(name: str, param: nn.Parameter) -> bool:
    """The usual AdamW rule (GPT-2, nanoGPT): decay matrices; not biases, norms or embeddings."""
    return param.dim() >= 2 and not any(part in name for part in ("tok.", "pos.", ".cls", ".pos"))


def block_matrix(name: str, param: nn.Parameter) -> bool:
    """Muon's rule: the weight matrices of the blocks' attention and MLP (an MoE layer's stacked experts
    too), not the embeddings, the head, norms, biases or an MoE router (Moonlight, Keller Jordan's Muon)."""
    return param.dim() >= 2 and any(part in name for part in (".attn.", ".mlp.")) and ".router." not in name


@dataclass(frozen=True)
class ModelSpec:
    kind: str
    """``model.kind`` in a config."""
    config: type[ModelConfig]
    """Its settings: the fields ``[model]`` may hold for it, their defaults and their checks."""
    task: str
    """What it learns: "language" (next-token prediction) or "images" (classification); the trainer's
    :mod:`polyshard.trainer.tasks` gives each its data, batches and loss."""
    build: Callable[[ModelConfig, BuildOptions], nn.Module]
    """The model, uninitialised (called under the meta device)."""
    tp_plan: Callable[[ModelConfig, ParallelSizes], dict[str, object]]
    """Tensor-parallel plan over every layer's global names, for the tp size and sequence parallelism."""
    shape: Callable[[ModelConfig], ModelShape] = plain_shape
    """Its block as numbers (:mod:`polyshard.models.shape`): attention widths, MLP and experts, norm,
    positions; what activation and KV-cache bytes and FLOPs per token are counted from."""
    has_experts: bool = False
    """Its MLPs are polyshard.ep MoE layers: experts shard over ep, their gradients reduce over dp x cp."""
    context_parallel: bool = False
    """Its attention layers (:class:`polyshard.models.common.Attention`) may be split over a cp axis:
    a causal language model whose sequence polyshard.cp can shard."""
    init: Callable[[nn.Module, int, torch.Generator | None], None] = init_weights
    """Initialise one pipeline layer in place: (layer, num_layers, generator)."""
    tied: Callable[[ModelConfig], dict[str, str]] = _no_ties
    """Parameters that are another parameter (tied weights): alias -> name."""
    decays: Callable[[str, nn.Parameter], bool] = decays
    """Whether AdamW decays this parameter (by model name)."""
    orthogonalised: Callable[[str, nn.Parameter], bool] = block_matrix
    """With ``optimizer.name = "muon"``: whether Muon steps this parameter (by model name); AdamW
    steps the others."""
    check: Callable[[ModelConfig, ParallelSizes], None] = _no_checks
    """Family constraints against the rest of the config, before launch (a :class:`ConfigError`)."""
    check_model: Callable[[ModelConfig], None] = lambda model: None
    """Family constraints between ``[model]`` fields, when the section is read."""
    sequence_length: Callable[[ModelConfig], int] = _no_sequence
    """Positions per example the transformer sees."""
    output_width: Callable[[ModelConfig], int] = _no_sequence
    """Outputs per position: the vocabulary of a language model, the classes of a classifier."""
    hf_adapters: tuple[HFAdapter, ...] = ()
    presets: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """Named settings (``model.preset``), each a ``[model]`` table."""
    """The Hugging Face architectures (``model_type``) its weights can map to (its adapters, one per ``model_type``)."""


def check_mlp_split(width: int, tp: int) -> None:
    """tp splits the MLP's hidden units (columns, then rows): it must divide their number."""
    if width % tp:
        raise ConfigError(f"parallel.tp={tp} does not divide the MLP width {width}; choose tp in {divisors(width)}")


def layer_of(name: str) -> int:
    """The pipeline layer of a model parameter name ``layers.<i>.…``."""
    return int(name.split(".")[1])


# -- tensor-parallel plan pieces the families share ------------------------------------------------------


def attention_plan(
    block: str, model: ModelConfig, parallel: ParallelSizes, *, qk_norm: bool = False, sinks: bool = False
) -> dict[str, object]:
    """Megatron-LM's attention: heads split over tp (q/k/v by columns, the output by rows); with more tp
    ranks than kv heads, each kv head computed on tp / kv_heads ranks (see polyshard.tp.heads)."""
    sp = parallel.sequence_parallel
    entry: list[object] = [TPEntry(sequence_parallel=sp), ShardHeads(replicate_kv=True)]
    if sinks:  # one logit per query head (gpt-oss): split with the heads
        entry.append(HeadParameter("sinks"))
    plan: dict[str, object] = {f"{block}.attn": entry}
    if replicates_kv(model.kv_heads, parallel.tp):
        plan[f"{block}.attn.q_proj"] = ColumnParallel(input_entered=True)
        plan[f"{block}.attn.[kv]_proj"] = ReplicateKVHeads(model.kv_heads)
    else:
        plan[f"{block}.attn.[qkv]_proj"] = ColumnParallel(input_entered=True)
    plan[f"{block}.attn.o_proj"] = RowParallel(sequence_parallel=sp)
    if qk_norm:  # one weight per head dim for every head: replicated, its gradient summed over tp
        plan[f"{block}.attn.[qk]_norm"] = HeadNorm()
    return plan


def mlp_plan(block: str, sp: bool, activation: str, mlp: str = "mlp") -> dict[str, object]:
    """The MLP's first matrices by columns and its last by rows: each rank's share is a whole MLP
    (SwiGLU's gate and up split alike). ``mlp``: its name in the block (an MoE's ``mlp.shared_expert``).

    SwiGLU's gate and up read one input: the MLP enters the tp region once for both (as attention does for
    q, k and v), so under sequence parallelism one all-gather brings the sequence and one copy of it is
    saved for their weight gradients, and their input gradients are summed before one reduce-scatter
    (all-reduce without SP). Each entering on its own gathered, saved and reduced it twice."""
    if activation == "swiglu":
        return {
            f"{block}.{mlp}": TPEntry(sequence_parallel=sp),
            f"{block}.{mlp}.gate_proj": ColumnParallel(input_entered=True),
            f"{block}.{mlp}.up_proj": ColumnParallel(input_entered=True),
            f"{block}.{mlp}.down_proj": RowParallel(sequence_parallel=sp),
        }
    return {
        f"{block}.{mlp}.fc_in": ColumnParallel(sequence_parallel=sp),
        f"{block}.{mlp}.fc_out": RowParallel(sequence_parallel=sp),
    }


def sequence_plan(block: str, sp: bool) -> dict[str, object]:
    """Under sequence parallelism the norms run on a sequence shard."""
    return {f"{block}.norm[12]": SequenceParallel()} if sp else {}


def split_sequence(first_block: int, sp: bool) -> dict[str, object]:
    """Embeddings are replicated over tp; under sequence parallelism the first block splits them."""
    return {f"layers.{first_block}": SplitSequence()} if sp else {}
