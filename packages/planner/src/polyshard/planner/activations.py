"""Activation memory per rank: the tensors autograd saves for backward, times the microbatches in flight.

Counted per token from what our transformer block saves (the same count, in 16-bit, is Korthikanti
et al. 2205.05198's 34·s·b·h without the attention-score term: scaled_dot_product_attention keeps
q, k, v, its output and one fp32 log-sum-exp per head instead of the s x s scores). Shapes: h
hidden, f MLP width, n query heads, k·h/n key/value width, e bytes per element (2 bf16, 4 fp32)::

    norms (x2)      LayerNorm: input + mean, rstd (h + 2)·e; RMSNorm: input, x·rstd, rstd in fp32 (2h + 1)·4
    linear inputs   the two normed tensors the q/k/v and MLP matmuls keep, whole even under SP: 2·h·e
    attention       q, k, v, output: (2h + 2·k·h/n)·e, plus n·4 log-sum-exp          ... / tp
    MLP             GELU: f·e twice; SwiGLU: gate, silu, up, product 4·f·e                ... / tp
    RoPE            cos and sin for q and k: 4·s·(h/n) fp32 per microbatch
    q/k norm        (Qwen3) as RMSNorm over q and k: (2·(h + k·h/n) + n + k)·4              ... / tp

Where ``model.head_dim`` is set, q's width is n·head_dim rather than h; an MoE block's f is an
expert's width, and its shared experts' SwiGLU (every token) counts like a dense one. tp does not
split the routed experts (ep does): without sequence parallelism each tp rank routes all its tokens,
so their part is whole on every tp rank, and ÷ tp only under SP (each rank routes its shard).

Multi-head latent attention (DeepSeek's MLA) keeps q and k n·(Dn + Dr) wide and v n·Dv, plus its latents:
the q latent and the kv latent with its rotary key (each a matmul output and an RMSNorm's input, x·rstd
and rstd in fp32), whole on every tp rank. Its inference cache holds (R + Dr)·e per token and layer
(:func:`kv_cache_bytes_per_token`), against 2·k·(h/n)·e for grouped-query attention.

Norms run on a sequence shard under sequence parallelism (÷ tp); context parallelism splits every
sequence (÷ cp); under Ulysses the core keeps q, k, v and its output as head shards of the whole sequence
(the same bytes), but k and v count once per copy where its all-to-all group outnumbers a tp rank's kv
heads; all-gather attention keeps the whole sequence's K and V in fp32 (2·k·h/n·4 per token of the
whole sequence, so cp times a local token's share). With full activation checkpointing a block keeps
its input alone, and one block's insides live again while it is recomputed. Selective checkpointing
(:mod:`polyshard.models.common.recompute`) keeps the input and every matmul and attention-kernel
output, and recomputes the rest::

    input           h·4, the float32 residual stream (÷ tp under SP)
    q, k, v         (h + 2·k·h/n)·e                                                      ... / tp
    attention       output and log-sum-exp h·e + n·4 (none under cp: the ring is recomputed) ... / tp
    MLP             GELU: f·e; SwiGLU: gate and up 2·f·e                                ... / tp
    row outputs     o_proj and the down projection before their reduction: 2·h·e, whole
    experts         router logits E·e, each routed copy's up (and gate) and down: top_k·(2f + h)·e  (÷ tp under SP)

The first layer keeps the token ids (int64); the head keeps its norm, its normed input and the loss's
fp32 log-probabilities (vocabulary ÷ tp), or with ``training.loss_chunks`` > 1 only the targets (each
chunk's logits are recomputed in backward).

``tests/planner/test_activations.py`` compares this with the peak of bytes saved for
backward measured by :class:`polyshard.trainer.loop.plan_check.SavedTensorMeter` on real engines;
``tests/trainer/test_selective_recompute.py`` one block's count in each checkpointing mode.
"""

from __future__ import annotations

from polyshard.models import output_width, sequence_length, spec_of
from polyshard.models.shape import ModelShape
from polyshard.planner.model_states import stage_bounds
from polyshard.planner.pipeline import peak_in_flight, stages_by_rank
from polyshard.trainer.config import Config, ModelConfig, ParallelConfig


def _element_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


def _shape(model: ModelConfig) -> ModelShape:
    """The family's block as numbers: norm, MLP, positions, attention widths, experts (its spec's ``shape``)."""
    return spec_of(model).shape(model)


def _norm(model: ModelConfig, e: int) -> float:
    return (model.hidden + 2) * e if _shape(model).norm == "layer" else (2 * model.hidden + 1) * 4


def micro_batch_size(config: Config) -> int:
    """Examples per microbatch on one data rank."""
    return config.training.global_batch_size // (config.parallel.data_ranks * config.parallel.microbatches)


def _kv_copies(model: ModelConfig, parallel: ParallelConfig) -> int:
    """Under Ulysses, how many copies of each kv head the attention core keeps: the all-to-all group's size
    over the kv heads of a tp rank, where it has fewer (polyshard.cp.ulysses repeats them); else 1."""
    if parallel.cp_style not in ("ulysses", "ulysses+ring"):
        return 1
    group = parallel.cp if parallel.cp_style == "ulysses" else parallel.cp_ulysses or 1
    return max(1, group // max(1, model.kv_heads // parallel.tp))


def kv_cache_bytes_per_token(model: ModelConfig, precision: str = "bf16") -> int:
    """Bytes an inference cache keeps per token over every layer: MLA's latent and shared rotary key, or
    grouped-query attention's k and v heads."""
    return model.num_layers * _shape(model).attention.cache_width * _element_bytes(precision)


def _mla_latent_bytes(model: ModelConfig, e: int) -> float:
    """MLA's latents, whole on every tp rank: each a matmul output, then an RMSNorm's x·rstd and rstd (fp32)."""
    attention = _shape(model).attention
    if not attention.latents:
        return 0.0
    return attention.shared_key_dim * e + sum(r * e + (r + 1) * 4 for r in attention.latents)


def block_bytes_per_token(model: ModelConfig, parallel: ParallelConfig, precision: str, sparse: bool = True) -> float:
    """Bytes one block keeps per token of a microbatch, on one rank (see the module docstring); ``sparse``:
    with experts, in a model that has them (else a dense MLP: ``model.moe.dense_layers``)."""
    shape = _shape(model)
    a = shape.attention  # MLA's values (and so the core's output) have their own width
    e, h, f, n = _element_bytes(precision), model.hidden, shape.mlp_width, a.heads
    q, kv, v, out = a.q_width, a.k_width, a.v_width, a.out_width
    tp, shard = parallel.tp, parallel.tp if parallel.sequence_parallel else 1
    outside = 2 * _norm(model, e) / shard + 2 * h * e + _mla_latent_bytes(model, e)  # whole on each rank
    # q, the output, and the core's k and v (repeated under Ulysses); one fp32 log-sum-exp per head
    attention = (q + out + (kv + v) * _kv_copies(model, parallel)) * e + n * 4
    if parallel.cp > 1 and parallel.cp_style == "allgather":  # the whole sequence's K and V, gathered in fp32
        attention += (kv + v) * 4 * parallel.cp
    if a.qk_norm:  # RMSNorm over each head of q and k: input, x·rstd, rstd in fp32
        attention += (2 * (q + kv) + n + a.kv_heads) * 4
    routed = 0.0  # tp does not split the routed experts: each tp rank routes all its tokens (its shard under SP)
    if shape.experts is not None and sparse:  # routed copies in and out, the experts' SwiGLU, router scores
        moe = shape.experts
        routed = 2 * moe.top_k * h * e + 4 * moe.expert_width * e + moe.num_experts * 4
        mlp = 4 * moe.shared_width * e  # the shared experts' SwiGLU, every token, its columns split by tp
    else:
        mlp = (2 if shape.activation == "gelu" else 4) * f * e
    return (outside + (attention + mlp) / tp + routed / shard) / parallel.cp


def _checkpointed_per_token(model: ModelConfig, parallel: ParallelConfig, precision: str) -> float:
    """The block's input: the residual stream, float32 even under bf16 autocast (a bf16 matmul output
    added to a float32 residual is float32)."""
    shard = parallel.tp if parallel.sequence_parallel else 1
    return model.hidden * 4 / shard / parallel.cp


def selective_bytes_per_token(
    model: ModelConfig, parallel: ParallelConfig, precision: str, sparse: bool = True
) -> float:
    """Bytes one block keeps per token under selective checkpointing (see the module docstring)."""
    shape = _shape(model)
    e, h, f, n = _element_bytes(precision), model.hidden, shape.mlp_width, shape.attention.heads
    q, kv = shape.attention.q_width, shape.attention.k_width
    columns = (q + 2 * kv) * e + ((q * e + n * 4) if parallel.cp == 1 else 0)  # q, k, v; the SDPA kernel's
    up = 1 if shape.activation == "gelu" else 2
    if shape.experts is not None and sparse:  # the router's logits and the experts' matmuls on their routed copies
        moe = shape.experts
        shard = parallel.tp if parallel.sequence_parallel else 1  # tp does not split them; SP splits the tokens
        rows = (h * e + moe.num_experts * e + moe.top_k * (up * moe.expert_width + h) * e) / shard
        columns += up * moe.shared_width * e  # the shared experts' gate and up, split by tp
    else:
        columns += up * f * e
        rows = 2 * h * e  # o_proj's and the MLP's last matmul, each (tokens, h) before the reduction
    return _checkpointed_per_token(model, parallel, precision) + (rows + columns / parallel.tp) / parallel.cp


def _head_per_token(model: ModelConfig, parallel: ParallelConfig, precision: str, loss_chunks: int = 0) -> float:
    e = _element_bytes(precision)
    shard = parallel.tp if parallel.sequence_parallel else 1
    vocab = output_width(model)
    loss = vocab * 4 / parallel.tp + 8  # fp32 log-probabilities of this rank's vocabulary, the target
    if loss_chunks > 1:  # the chunked loss keeps each chunk's input (the normed states, counted) and target
        loss = 8
    return (_norm(model, e) / shard + model.hidden * e + loss) / parallel.cp


def stage_bytes(config: Config, layers: range, micro_batch: int, checkpointing: bool | str | None = None) -> float:
    """Bytes one microbatch leaves saved on the stage holding pipeline ``layers``; ``checkpointing``
    (default: the config's ``training.activation_checkpointing``): False, "full" (or True: blocks keep
    their input alone) or "selective"."""
    model, parallel, precision = config.model, config.parallel, config.training.precision
    if checkpointing is None:
        checkpointing = config.training.activation_checkpointing
    seq = sequence_length(model)
    tokens = micro_batch * seq
    last = model.num_layers + 1
    shape = _shape(model)
    total = 0.0
    for i in (i for i in layers if 0 < i < last):
        sparse = shape.sparse(i - 1)
        if checkpointing == "selective":
            per_block = selective_bytes_per_token(model, parallel, precision, sparse) * tokens
        elif checkpointing:
            per_block = _checkpointed_per_token(model, parallel, precision) * tokens
        else:
            per_block = block_bytes_per_token(model, parallel, precision, sparse) * tokens
            if shape.rotary:  # cos and sin for q and k, per microbatch
                per_block += 16 * seq * shape.attention.qk_head_dim
        total += per_block
    if 0 in layers:
        total += 8 * tokens  # the int64 token ids
    if last in layers:
        total += _head_per_token(model, parallel, precision, config.training.loss_chunks) * tokens
    return total


def recompute_bytes(config: Config, micro_batch: int) -> float:
    """What one block's insides take while activation checkpointing recomputes it (0 without); under
    selective checkpointing the recomputed block reuses the kept matmul outputs, so only the rest is new."""
    mode = config.training.activation_checkpointing
    if not mode:
        return 0.0
    model, parallel, precision = config.model, config.parallel, config.training.precision
    per_token = block_bytes_per_token(model, parallel, precision)
    if mode == "selective":
        kept = selective_bytes_per_token(model, parallel, precision) - _checkpointed_per_token(
            model, parallel, precision
        )
        per_token = max(per_token - kept, 0.0)
    return per_token * micro_batch * sequence_length(model)


def activation_bytes(config: Config, pp_rank: int) -> float:
    """Peak bytes saved for backward on pipeline rank ``pp_rank``: the simulator's peak count of
    (stage, microbatch) pairs in flight there, times the heaviest of its stages."""
    par = config.parallel
    micro_batch = micro_batch_size(config)
    bounds = stage_bounds(config)
    placement = stages_by_rank(par.schedule, par.pp, par.virtual_stages)
    heaviest = max(stage_bytes(config, bounds[s], micro_batch) for s in placement[pp_rank])
    in_flight = peak_in_flight(par.schedule, par.pp, par.microbatches, par.virtual_stages)[pp_rank]
    return in_flight * heaviest + recompute_bytes(config, micro_batch)
