"""The settings: one frozen dataclass per ``[section]`` of a config, each field documented by the line
under it and checked for its own range when built (``__post_init__``). Rules between sections are
:mod:`polyshard.trainer.config.rules`' (no processes needed) and
:func:`polyshard.trainer.engine.constraints.validate`'s (the mesh and the processes); a model family's
own constraints are its spec's (:func:`polyshard.models.check_model`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from polyshard.models.config import ModelConfig
from polyshard.models.errors import ConfigError
from polyshard.models.errors import check_at_least as _check_at_least
from polyshard.models.errors import check_choice as _check_choice
from polyshard.models.errors import check_positive as _check_positive
from polyshard.models.gpt.config import GPTConfig
from polyshard.trainer.config.dpo import DPOConfig
from polyshard.trainer.config.grpo import GRPOConfig
from polyshard.trainer.config.lora import LoRAConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
V_SCHEDULES = ("zb-v", "dualpipev")  # two stages per pipeline rank in a V: virtual_stages = 2
SPLIT_BACKWARD = ("zb-h1", "zb-v", "dualpipev")  # backward split into B (input gradient) and W (weights)
MESH_AXES = ("pp", "dp", "ep", "cp", "tp")  # outermost first: tp fastest, so its ranks are neighbours
PRECISIONS = ("fp32", "bf16")
RECOMPUTE = (False, "selective", "full")  # training.activation_checkpointing, least recompute first
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")  # lr_schedule.name: the learning rate after warmup
DECAY_SHAPES = ("linear", "cosine", "sqrt")
OPTIMIZERS = ("adamw", "muon")
ADAMW_IMPLS = ("auto", "foreach", "fused", "for-loop")  # torch.optim.AdamW's kernels
IDLE_EXPERTS = ("step", "skip")  # optimizer.idle_experts: stepped with zero gradient, or left as they were
DECAYED_PARAMS = ("matrices", "all")
WANDB_MODES = ("online", "offline", "disabled")  # logging.wandb_mode: wandb.init's modes
TASKS = ("auto", "dpo", "grpo")  # training.task: the family's own, preference pairs ([dpo]), rewards ([grpo])


CP_STYLES = ("ring", "allgather", "ulysses", "ulysses+ring")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    dp: int = 1
    """Data-parallel replicas (or ZeRO shards). "auto" in a file or --set: whatever the other axes leave of
    the processes present (elastic jobs); the global batch stays, each data rank takes a larger part."""
    dp_shard: int | None = None
    """Hybrid sharding (HSDP): ZeRO shards over groups of dp_shard neighbouring data ranks (x ep x cp) and
    replicates across the dp / dp_shard groups; the mesh splits dp into dp_replicate x dp_shard. Must divide
    dp and needs zero_stage >= 1. None (or dp): shard over every data rank."""
    tp: int = 1
    """Tensor-parallel ranks (neighbouring ranks; the fastest mesh axis)."""
    pp: int = 1
    """Pipeline stages."""
    ep: int = 1
    """Expert-parallel ranks; they also split the batch, so non-expert gradients reduce over dp x ep."""
    cp: int = 1
    """Context-parallel ranks: each sequence is split over them (load-balanced chunks, see polyshard.cp),
    so attention's activations per rank fall as 1/cp; gradients reduce (and ZeRO shards) over dp x ep x cp,
    experts' over dp x cp. MoE layers compute their aux losses over the cp group's tokens."""
    cp_style: str = "ring"
    """How context-parallel attention sees the other ranks' keys and values: 'ring' (passed round the cp
    ranks, overlapped with compute), 'allgather' (gathered once per layer; Llama 3's choice for GQA),
    'ulysses' (all-to-alls turn the sequence split into a head split around the attention core; the heads
    after tp must divide by cp) or 'ulysses+ring' (all-to-all over cp_ulysses neighbouring cp ranks, ring
    across them: for more cp ranks than heads)."""
    cp_ulysses: int | None = None
    """With cp_style 'ulysses+ring': the cp ranks of each all-to-all group (a divisor of cp between 1 and
    cp); the ring spans cp / cp_ulysses. Unused by the other styles."""
    sequence_parallel: bool = False
    """Keep activations between tensor-parallel regions sharded along the sequence."""
    zero_stage: int = 0
    """0 plain data parallel, 1 optimizer state, 2 + gradients, 3 + parameters sharded."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved, zb-h1, zb-v or dualpipev (the last two need
    virtual_stages=2; dualpipev also microbatches >= 2 x pp)."""
    virtual_stages: int = 1
    """Model stages per pipeline rank: any for interleaved, 2 for zb-v and dualpipev (a V), else 1."""
    microbatches: int = 1
    """Microbatches per step (pipeline microbatches and gradient accumulation)."""
    timeout_s: float = 600.0
    """Seconds any collective may wait for a peer before the job fails (a stopped or lost rank)."""
    stage_layers: list[int] | None = None
    """Pipeline layers per stage, e.g. [3, 2, 2, 1] (embedding and head count as layers); None balances by size."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep", "cp", "virtual_stages", "microbatches"):
            _check_positive(f"parallel.{name}", getattr(self, name))
        _check_choice("parallel.cp_style", self.cp_style, CP_STYLES)
        _check_choice("parallel.schedule", self.schedule, SCHEDULES)
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # gloo and NCCL take it as a C++ duration
            raise ConfigError(
                f"parallel.timeout_s={self.timeout_s} must be in (0, {MAX_TIMEOUT_S:g}] seconds (default 600; a "
                "collective that waits a week is a hang)"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero_stage={self.zero_stage}; choose 0, 1, 2 or 3")
        if self.dp_shard is not None:
            _check_positive("parallel.dp_shard", self.dp_shard)
            if self.dp_shard == self.dp:  # sharding over all of dp: one spelling of it, None
                object.__setattr__(self, "dp_shard", None)
        if self.stage_layers is not None and (
            not isinstance(self.stage_layers, list) or not all(isinstance(n, int) and n >= 1 for n in self.stage_layers)
        ):
            raise ConfigError(f"parallel.stage_layers={self.stage_layers!r} must be a list of layer counts >= 1")

    @property
    def hybrid(self) -> bool:
        """Whether ZeRO shards over only part of dp (dp_shard < dp) and replicates across the rest."""
        return self.dp_shard is not None and self.dp_shard < self.dp

    @property
    def dp_replicate(self) -> int:
        """Replicas of each ZeRO shard: dp / dp_shard (1 without hybrid sharding)."""
        return self.dp // self.dp_shard if self.hybrid and self.dp_shard else 1

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """Mesh axes a (non-expert) parameter's ZeRO shards split over: :attr:`replica_axes`, with dp narrowed
        to dp_shard under hybrid sharding."""
        return ("dp_shard", "ep", "cp") if self.hybrid else self.replica_axes

    @property
    def expert_shard_axes(self) -> tuple[str, ...]:
        """The same for an expert's parameters below ZeRO-3 (:attr:`expert_replica_axes`, dp narrowed to
        dp_shard under hybrid sharding)."""
        return ("dp_shard", "cp") if self.hybrid else self.expert_replica_axes

    @property
    def replicate_axes(self) -> tuple[str, ...]:
        """Mesh axes holding copies of each ZeRO shard: dp_replicate under hybrid sharding, else none."""
        return ("dp_replicate",) if self.hybrid else ()

    @property
    def world_size(self) -> int:
        return self.dp * self.ep * self.cp * self.pp * self.tp

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes that split each global batch's examples: every coordinate on them is a data rank."""
        return ("dp", "ep")

    @property
    def data_ranks(self) -> int:
        """Data ranks: each takes global_batch_size / data_ranks examples per step."""
        return self.dp * self.ep

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """Mesh axes over which a (non-expert) parameter is replicated: its gradient averages over them,
        and ZeRO shards it over them. cp ranks hold the same examples' other tokens: replicas too."""
        return ("dp", "ep", "cp")

    @property
    def expert_replica_axes(self) -> tuple[str, ...]:
        """Mesh axes over which an expert parameter is replicated (the ranks holding the same experts):
        dp, and cp, whose ranks route other tokens of the same sequences. Its gradient sums over them and
        divides by every replica (dp x ep x cp: it already summed the ep ranks' tokens); ZeRO shards it
        over them."""
        return ("dp", "cp")

    @property
    def replicas(self) -> int:
        """Ranks holding one replica each of a (non-expert) parameter: dp x ep x cp."""
        return self.dp * self.ep * self.cp

    @property
    def mesh_axes(self) -> dict[str, int]:
        """Mesh axes, outermost first: tp last so tensor-parallel ranks are neighbours, cp next to it
        (both talk every layer). Hybrid sharding splits dp into dp_replicate x dp_shard (shard fastest, so
        a shard group is neighbouring ranks: on one node when it fits); the mesh answers for "dp" as the pair."""
        axes = {axis: getattr(self, axis) for axis in MESH_AXES}
        if not self.hybrid:
            return axes
        out: dict[str, int] = {}
        for axis, size in axes.items():
            if axis == "dp":  # replicate outer, shard inner (faster)
                out |= {"dp_replicate": self.dp_replicate, "dp_shard": self.dp // self.dp_replicate}
            else:
                out[axis] = size
        return out


@dataclass(kw_only=True, frozen=True)
class TrainingConfig:
    task: str = "auto"
    """What the model learns: 'auto', its family's task (next token, or masked completion for a .jsonl of
    pairs; images for the ViT), 'dpo': preference pairs, with the [dpo] section's settings, or 'grpo': its own
    completions of prompts scored by rewards, with the [grpo] section's settings."""
    steps: int = 100
    """Optimizer steps."""
    global_batch_size: int = 16
    """Sequences (or images; preference pairs with task = 'dpo'; prompts with task = 'grpo', each giving
    grpo.generations rows) per optimizer step, over all data ranks and
    microbatches."""
    seed: int = 0
    """Seeds the weights, the data order and dropout."""
    precision: str = "fp32"
    """fp32, or bf16 autocast compute with fp32 master weights."""
    activation_checkpointing: bool | str = False
    """Recompute activations in the backward pass: 'full' (each block keeps its input alone), 'selective'
    (blocks keep their matmul and attention outputs and recompute norms, activations and rope), or false.
    true means 'full' (what it meant before 'selective' existed)."""
    compile: bool = False
    """torch.compile each transformer block (one compiled graph that every block reuses); collectives stay
    eager at graph breaks. The first steps pay the compile time; metrics.jsonl records compiles."""
    on_nonfinite: str = "skip"
    """A step whose loss or gradient norm is NaN or infinite: 'skip' it (no rank updates) or 'stop' the run."""
    nonfinite_patience: int = 3
    """With on_nonfinite = 'skip': stop after this many non-finite steps in a row."""
    stop_at: int = 0
    """End the run after this step with a checkpoint (0: after `steps`). The learning-rate schedule still
    spans `steps`, so a run resumed from there continues exactly as an uninterrupted one (preemption windows)."""
    loss_chunks: int = 0
    """Language models: compute the head's projection and the cross-entropy this many chunks of tokens at a
    time, each chunk's logits recomputed in the backward, so the full (tokens x vocabulary) logits never
    exist; 0 or 1: all at once."""
    mtp_loss_weight: float = 0.3
    """With model.mtp_depth > 0: lambda, the multi-token prediction loss's weight; the step trains
    loss + lambda / D x (the D depths' losses), and logs loss (next token only) and mtp_loss apart.
    0.3 is DeepSeek-V3's for its first 10T tokens (0.1 after; Megatron-Core defaults to 0.1)."""
    consistency_every: int = 100
    """Every N steps (and before each checkpoint) check that data-parallel replicas hold bitwise equal
    parameters: one all-gather of a checksum per rank; a replica that drifted stops the run (0 disables)."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size"):
            _check_positive(f"training.{name}", getattr(self, name))
        _check_choice("training.task", self.task, TASKS)
        _check_choice("training.precision", self.precision, PRECISIONS)
        if isinstance(self.activation_checkpointing, bool):  # true, in older configs and checkpoints: full
            object.__setattr__(self, "activation_checkpointing", "full" if self.activation_checkpointing else False)
        _check_choice("training.activation_checkpointing", self.activation_checkpointing, RECOMPUTE)
        _check_choice("training.on_nonfinite", self.on_nonfinite, ("skip", "stop"))
        if not isinstance(self.loss_chunks, int) or isinstance(self.loss_chunks, bool) or self.loss_chunks < 0:
            raise ConfigError(f"training.loss_chunks={self.loss_chunks!r} must be an integer >= 0 (0 or 1: off)")
        if not (isinstance(self.mtp_loss_weight, int | float) and 0.0 <= self.mtp_loss_weight < float("inf")):
            raise ConfigError(
                f"training.mtp_loss_weight={self.mtp_loss_weight!r} must be a number >= 0 (DeepSeek-V3: 0.3, then 0.1)"
            )
        _check_positive("training.nonfinite_patience", self.nonfinite_patience)
        for name in ("seed", "stop_at", "consistency_every"):
            _check_at_least(f"training.{name}", getattr(self, name), 0)
        if self.seed > MAX_SEED:  # torch seeds are 64-bit, and each layer's is seed x 1,000,003 + its index
            raise ConfigError(f"training.seed={self.seed} is past {MAX_SEED:,}; give a seed in 0..{MAX_SEED}")

    @property
    def last_step(self) -> int:
        """The step this run ends at: `stop_at` when given, else `steps`."""
        return self.stop_at or self.steps


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """``[optimizer]``: what steps the weights, and by how much."""

    name: str = "adamw"
    """'adamw', or 'muon': Newton-Schulz orthogonalised momentum for the blocks' weight matrices (experts'
    one by one) with Moonlight's 0.2 * sqrt(max(m, n)) update scale, so `lr` and `weight_decay` carry
    over from AdamW; AdamW (`beta1`, `beta2`) for embeddings, head, norms, biases and routers. Each
    matrix is orthogonalised whole, on one rank of those holding its tp/ZeRO pieces."""
    lr: float = 1e-3
    """Peak learning rate (of AdamW; Muon's matrices scale it by their shape); [lr_schedule] shapes it over
    the steps."""
    weight_decay: float = 0.1
    """AdamW weight decay, on the parameters `weight_decay_params` names."""
    weight_decay_params: str = "matrices"
    """Which parameters decay: 'matrices' (GPT-2, nanoGPT: not norms, biases or embeddings) or 'all'
    (torchtitan)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    adamw_impl: str = "auto"
    """AdamW's kernel (torch.optim.AdamW): 'auto' (torch's choice: foreach), 'foreach' (one kernel per op over
    all tensors), 'fused' (one kernel for the whole step; CPU and CUDA) or 'for-loop' (tensor by tensor)."""
    muon_momentum: float = 0.95
    """name = 'muon': the momentum of the matrices' buffer."""
    muon_nesterov: bool = True
    """name = 'muon': orthogonalise the Nesterov look-ahead (gradient + momentum x buffer) rather
    than the buffer."""
    muon_ns_steps: int = 5
    """name = 'muon': Newton-Schulz iterations (5 with the usual quintic coefficients)."""
    idle_experts: str = "step"
    """An expert that no token was routed to in a step (on any rank): 'step' steps it with the rest of its
    layer's experts, a zero gradient, so weight decay and its momentum still move it (what transformers 5,
    torchtitan and Megatron-Core do: they hold a layer's experts as one tensor); 'skip' leaves its weights,
    fp32 masters and AdamW moments exactly as they were, as for a parameter without a gradient (per-expert
    parameters; polyshard's rule before this setting existed)."""

    def __post_init__(self) -> None:
        _check_choice("optimizer.name", self.name, OPTIMIZERS)
        _check_choice("optimizer.adamw_impl", self.adamw_impl, ADAMW_IMPLS)
        _check_choice("optimizer.weight_decay_params", self.weight_decay_params, DECAYED_PARAMS)
        _check_choice("optimizer.idle_experts", self.idle_experts, IDLE_EXPERTS)
        if not self.lr > 0:
            raise ConfigError(f"optimizer.lr={self.lr} must be > 0")
        for name in ("grad_clip", "weight_decay"):
            _check_at_least(f"optimizer.{name}", getattr(self, name), 0)
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optimizer.{name}={getattr(self, name)} must be in [0, 1) (AdamW uses 0.9 and 0.95)")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"optimizer.muon_momentum={self.muon_momentum} must be in [0, 1) (Muon uses 0.95)")
        _check_positive("optimizer.muon_ns_steps", self.muon_ns_steps)
        if self.muon_ns_steps > MAX_MUON_NS_STEPS:  # each step is three matmuls per matrix: 1e9 never ends
            raise ConfigError(
                f"optimizer.muon_ns_steps={self.muon_ns_steps} is past {MAX_MUON_NS_STEPS}; Muon converges in 5 "
                "(--set optimizer.muon_ns_steps=5)"
            )
        if not isinstance(self.muon_nesterov, bool):
            raise ConfigError(f"optimizer.muon_nesterov={self.muon_nesterov!r} must be true or false")


@dataclass(kw_only=True, frozen=True)
class LRScheduleConfig:
    """``[lr_schedule]``: the learning rate of each step, from optimizer.lr."""

    name: str = "cosine"
    """After warmup: 'cosine' (cosine decay to min_lr at training.steps), 'linear' (linear decay to min_lr),
    'constant' (lr), or 'wsd' (warmup-stable-decay: lr, then the last `decay_fraction` of the steps decay
    to min_lr in the shape `decay_shape`)."""
    warmup_steps: int = 10
    """Linear warmup from 0 to optimizer.lr."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay (at most optimizer.lr)."""
    decay_fraction: float = 0.2
    """name = 'wsd': the share of training.steps spent decaying, at the end of the run (MiniCPM uses ~0.1-0.2)."""
    decay_shape: str = "linear"
    """name = 'wsd': the decay's shape: 'linear', 'cosine' or 'sqrt' (1 - sqrt of the decay's progress)."""

    def __post_init__(self) -> None:
        _check_choice("lr_schedule.name", self.name, LR_SCHEDULES)
        _check_choice("lr_schedule.decay_shape", self.decay_shape, DECAY_SHAPES)
        _check_at_least("lr_schedule.warmup_steps", self.warmup_steps, 0)
        _check_at_least("lr_schedule.min_lr", self.min_lr, 0)
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(
                f"lr_schedule.decay_fraction={self.decay_fraction} must be in (0, 1] (e.g. 0.2: the last 20%)"
            )

    def decay_steps(self, steps: int) -> int:
        """name = 'wsd': the steps at the end of a run of ``steps`` spent decaying (at least one)."""
        return max(1, round(self.decay_fraction * steps))


@dataclass(kw_only=True, frozen=True)
class EvalConfig:
    """``[eval]``: the validation loss during the run, and the text sampled at its end."""

    every: int = 50
    """Evaluate on the validation split every N steps (0 disables)."""
    batches: int = 4
    """Global batches per evaluation, from the start of the validation split; 0 evaluates all of it."""
    sample_tokens: int = 200
    """Tokens of text to sample from the GPT at the end (0 disables)."""

    def __post_init__(self) -> None:
        for name in ("every", "batches", "sample_tokens"):
            _check_at_least(f"eval.{name}", getattr(self, name), 0)
        if self.sample_tokens > MAX_SAMPLE_TOKENS:  # each token is a forward pass over the whole row, on rank 0
            raise ConfigError(
                f"eval.sample_tokens={self.sample_tokens} is past {MAX_SAMPLE_TOKENS:,}; the end-of-run sample "
                f"is text to read: give 0..{MAX_SAMPLE_TOKENS} (0 disables it)"
            )


@dataclass(frozen=True)
class WeightedSource:
    """One entry of ``[[data.sources]]``: a source (as ``data.source``) and its share of every global batch."""

    path: str
    weight: float = 1.0


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    source: str = "shakespeare"
    """'shakespeare' (built in), 'digits' (built in, for the ViT), 'synthetic' (seeded rows of the model's
    vocabulary, no file: benchmarks and planning, as Megatron's mock data), a prepared dataset folder
    (`polyshard prepare`), a local text file or folder, a dataset name, or a .jsonl file of prompt/response
    pairs for fine-tuning: one JSON object per line, and only response tokens count in the loss. Anything but
    a prepared folder is prepared on first use into the cache (keyed by its content and the tokenizer) and read
    from there."""
    sources: list[WeightedSource] | None = None
    """A mixture instead of `source`: [[data.sources]] entries with `path` and `weight`; each global batch draws
    from each in proportion to its weight, the same on every layout."""
    val_source: str | None = None
    """Validate on this source (prepared or not) instead of the documents held out of the training source."""
    val_fraction: float = 0.1
    """Share of the documents held out for validation (chosen by a seeded hash when the source is prepared; a
    corpus of one document holds out the last share of its windows instead)."""
    separator: str = "\n"
    """With a tokenizer that has no end-of-text token (bytes): the text that ends every document."""
    shuffle: bool = True
    """Shuffle training examples (seeded by training.seed)."""
    tokenizer: str = "bytes"
    """'bytes' (each UTF-8 byte a token), or a tokenizer.json (or a folder holding one, e.g. a Hugging Face
    model's) read with the tokenizers library; `polyshard tokenizer` trains a byte-level BPE."""
    prompt_field: str = "prompt"
    """With a .jsonl source: the field holding each example's prompt (read, never scored), e.g. 'document'."""
    response_field: str = "response"
    """With a .jsonl source: the field holding the response, the tokens the loss counts, e.g. 'summary'."""
    packing: bool = False
    """With a .jsonl source: false (the default) gives each example its own row, padded, so it attends only to
    itself; true joins examples end to end and cuts the stream into rows like text: no padding, but attention
    crosses example boundaries (a response also sees the examples before it in its row)."""
    document_mask: bool = False
    """Keep attention inside each document of a packed row (a block-diagonal causal mask) and restart the
    positions (rotary or learned) at each document, as Llama 3 trained; false: the plain causal mask over the
    whole row. Rows carry each token's document in a `segments` column (text and packed pairs)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be strictly between 0 and 1")
        if self.sources is not None:
            object.__setattr__(self, "sources", [_weighted_source(i, s) for i, s in enumerate(self.sources)])
            if not self.sources:
                raise ConfigError("data.sources is empty; give [[data.sources]] entries or drop it and set data.source")
        if not self.prompt_field or not self.response_field or self.prompt_field == self.response_field:
            raise ConfigError(
                f"data.prompt_field={self.prompt_field!r} and data.response_field={self.response_field!r} "
                "must name two different JSON fields"
            )

    @property
    def mixture(self) -> list[WeightedSource]:
        """The training sources with their weights: ``sources``, or ``source`` alone."""
        return self.sources if self.sources is not None else [WeightedSource(self.source)]


MAX_WEIGHT = 1e12  # a mixture weight; relative, so token counts fit and no sum of weights overflows
MAX_SEED = 2**32 - 1  # training.seed: a 32-bit seed, as numpy's legacy one; larger overflowed in the workers
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # parallel.timeout_s: a week; 1e300 s overflowed the workers' C++ duration
MAX_SAMPLE_TOKENS = 100_000  # eval.sample_tokens: rank 0 keeps every token it generates (8 bytes each)
MAX_MUON_NS_STEPS = 100  # Newton-Schulz iterations of Muon; 5 suffice (Jordan et al.), far more is a typo


def _weighted_source(index: int, entry: Any) -> WeightedSource:
    where = f"data.sources[{index}]"
    if isinstance(entry, WeightedSource):
        entry = {"path": entry.path, "weight": entry.weight}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} is {entry!r}; each entry is a table with path and weight")
    unknown = set(entry) - {"path", "weight"}
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {sorted(unknown)}; an entry has path and weight")
    path, weight = entry.get("path"), entry.get("weight", 1.0)
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}.path={path!r} must name a source (a prepared folder, a file or 'shakespeare')")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ConfigError(f"{where}.weight={weight!r} must be a positive number")
    if weight > MAX_WEIGHT:  # their sum and the loader's (t + 1) * w shares must stay finite
        raise ConfigError(
            f"{where}.weight={weight!r} is past {MAX_WEIGHT:g}; weights are relative: scale them all down "
            "(e.g. 0.7 and 0.3)"
        )
    return WeightedSource(path, float(weight))


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    every: int = 0
    """Save every N steps (0: only at the end)."""
    keep: int = 2
    """Complete checkpoints to keep; older ones are deleted."""
    hf_every: int = 0
    """Also write the checkpoint of every N-th step as a Hugging Face folder, <run>/hf/step_<N>, that
    transformers loads (every family with a Hugging Face counterpart; 0: never). N is a multiple of `every`."""
    async_save: bool = False
    """Save without stopping training: each rank copies its state to host memory at the step boundary and a
    background thread writes, hashes and publishes the files; the next save and the run's end wait for it.
    A crash mid-write leaves the previous checkpoint the newest complete one. Costs one host copy of the state."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep >= 1")
        _check_at_least("checkpoint.hf_every", self.hf_every, 0)


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    every: int = 1
    """Write a metrics line every N steps."""
    progress_bar: bool = True
    """Show a progress bar with loss, tokens/s and ETA on rank 0."""
    peak_tflops: float | None = None
    """Peak TFLOP/s per process for MFU (`polyshard bench matmul` measures it)."""
    profile_steps: list[int] | None = None
    """[first, last]: profile steps first..last (counted from 1, both included) with torch.profiler on every
    rank: a Chrome trace per rank in <run>/profile/rank<N>.json and, with pp > 1, the pipeline timeline of the
    last profiled step as measured beside the simulator's prediction (profile/pipeline.txt and .svg)."""
    tensorboard: bool = False
    """Also write each metrics record as TensorBoard scalars into <run>/tensorboard/ (rank 0); needs the
    tensorboard package: pip install 'polyshard-trainer[tensorboard]'."""
    wandb: bool = False
    """Also log the run to Weights & Biases (rank 0): the resolved config once, then each metrics record at
    its step; the W&B run's id is kept in <run>/wandb_run.json, so --resume continues the same W&B run.
    Needs the wandb package: pip install 'polyshard-trainer[wandb]'."""
    wandb_project: str | None = None
    """The W&B project; None: WANDB_PROJECT, else wandb's default ("uncategorized")."""
    wandb_entity: str | None = None
    """The W&B team or user the run belongs to; None: WANDB_ENTITY, else the logged-in user's default."""
    wandb_run_name: str | None = None
    """The W&B run's display name; None: WANDB_NAME, else one wandb makes up."""
    wandb_tags: list[str] = field(default_factory=list)
    """Tags on the W&B run, e.g. ["llama", "tp2"]."""
    wandb_mode: str | None = None
    """online (sync as it runs), offline (files only, `wandb sync` later) or disabled; None: WANDB_MODE,
    else online."""

    def __post_init__(self) -> None:
        _check_positive("logging.every", self.every)
        if self.wandb_mode is not None:
            _check_choice("logging.wandb_mode", self.wandb_mode, WANDB_MODES)
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"logging.peak_tflops={self.peak_tflops} must be > 0, or unset")
        if self.profile_steps is not None:
            _check_step_range("logging.profile_steps", self.profile_steps)


@dataclass(kw_only=True, frozen=True)
class Config:
    model: ModelConfig = field(default_factory=GPTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    lora: LoRAConfig | None = None
    """Train LoRA adapters beside the frozen model (None: train every weight)."""
    dpo: DPOConfig | None = None
    """training.task = 'dpo''s settings (None: TRL's defaults when the task is dpo)."""
    grpo: GRPOConfig | None = None
    """training.task = 'grpo''s settings: sampling, the clipped objective and the [[grpo.rewards]] (needed)."""


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "lr_schedule": LRScheduleConfig,
    "eval": EvalConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "lora": LoRAConfig,
    "dpo": DPOConfig,
    "grpo": GRPOConfig,
}


# -- helpers -------------------------------------------------------------------
def _check_step_range(name: str, value: Any) -> None:
    """``[first, last]``: two steps counted from 1, first <= last (the bound by training.steps is
    :func:`polyshard.trainer.engine.constraints.validate`'s)."""
    ints = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if not ints or len(value) != 2:
        raise ConfigError(f"{name}={value!r} must be two steps [first, last], e.g. [2, 3]")
    first, last = value
    if first < 1:
        raise ConfigError(f"{name}={value!r}: steps count from 1; give [first, last], e.g. [1, {max(last, 1)}]")
    if first > last:
        raise ConfigError(
            f"{name}={value!r}: the first step comes after the last; give [first, last], e.g. [{last}, {first}]"
        )
