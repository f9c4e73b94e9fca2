"""DeepSeek-V3 / V2 as plain PyTorch: the GPT's layers (embedding, blocks, head) with multi-head latent
attention in every block (:class:`polyshard.models.common.mla.MLA`), a dense SwiGLU MLP in the
``moe.dense_layers`` blocks (the first ones) and an MoE layer (sigmoid, group-limited routing with a selection bias and
shared experts, :class:`polyshard.models.moe_gpt.model.MoEMLP`) in the others."""

from __future__ import annotations

from typing import cast

from polyshard.mesh import divisors
from polyshard.models.common.mla import MLA
from polyshard.models.common.mtp import PredictionDepth
from polyshard.models.config import ModelConfig
from polyshard.models.deepseek_v3.config import DeepSeekV3Config, deepseek_config
from polyshard.models.deepseek_v3.hf import DEEPSEEK_V2, DEEPSEEK_V3
from polyshard.models.deepseek_v3.presets import PRESETS
from polyshard.models.errors import ConfigError
from polyshard.models.gpt import model as gpt
from polyshard.models.moe_gpt import model as moe_gpt
from polyshard.models.spec import (
    BuildOptions,
    ModelSpec,
    ParallelSizes,
    check_mlp_split,
    mlp_plan,
    sequence_plan,
    split_sequence,
)
from polyshard.tp import ColumnParallel, HeadNorm, RowParallel, TPEntry


def mla(config: DeepSeekV3Config) -> MLA:
    """One block's attention."""
    return MLA(
        config.hidden,
        config.num_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        softmax_scale=config.softmax_scale,
        norm_eps=1e-6,  # the latents' norms keep DeepSeek's epsilon whatever rms_norm_eps says (as transformers)
        bias=config.attention_bias,
        interleaved=config.rope_interleave,
        core=config.attention_core,
    )


def build(config: ModelConfig, options: BuildOptions) -> gpt.GPT:
    """The GPT's layers with MLA in each block, MoE MLPs in the sparse ones (:meth:`~DeepSeekV3Config.sparse_layer`)."""
    config = deepseek_config(config)
    model = gpt.build(config, options)
    layer = config.layer()
    head = cast(gpt.LMHead, model.layers[-1])
    depths = [cast(PredictionDepth, depth).block for depth in head.mtp.depths] if head.mtp is not None else []
    for i, block in enumerate([*model.layers[1:-1], *depths]):  # a prediction depth's block is like the last
        block.attn = mla(config)
        if config.sparse_layer(min(i, config.num_layers - 1)):
            block.mlp = moe_gpt.MoEMLP(layer, aux_loss_scale=options.aux_loss_scale, shared_hidden=config.shared_width)
    return model


def mla_plan(block: str, config: DeepSeekV3Config, sp: bool) -> dict[str, object]:
    """Heads split over tp: the up projections by columns, the output by rows. The down projections and
    their norms stay whole on every rank; each rank's heads use part of their outputs, so their
    gradients are summed over tp (flagged as a q/k norm's are). The attention's input enters the tp
    region once (its gradient summed over tp; all-gathered along the sequence under SP)."""
    attn = f"{block}.attn"
    plan: dict[str, object] = {attn: TPEntry(sequence_parallel=sp), f"{attn}.o_proj": RowParallel(sequence_parallel=sp)}
    ups = ("q_proj",) if config.q_lora_rank is None else ("q_up",)
    for name in (*ups, "kv_up"):
        plan[f"{attn}.{name}"] = ColumnParallel(input_entered=True)
    downs = ("kv_down", "kv_norm") + (() if config.q_lora_rank is None else ("q_down", "q_norm"))
    for name in downs:
        plan[f"{attn}.{name}"] = HeadNorm()
    return plan


def tp_plan(model: ModelConfig, parallel: ParallelSizes) -> dict[str, object]:
    """MLA's heads split; dense MLPs and shared experts split like Llama's MLP; routed experts are ep's."""
    config = deepseek_config(model)
    plan: dict[str, object] = {}
    sp = parallel.sequence_parallel
    depths = [f"layers.{config.num_layers + 1}.mtp.depths.{k}.block" for k in range(config.mtp_depth)]
    for i, block in enumerate([f"layers.{i + 1}" for i in range(config.num_layers)] + depths):
        inside = sp and i < config.num_layers  # a depth runs on whole sequences (no SP inside)
        plan |= mla_plan(block, config, inside) | sequence_plan(block, inside)  # SP: norms see a sequence shard
        if not config.sparse_layer(min(i, config.num_layers - 1)):
            plan |= mlp_plan(block, inside, "swiglu")
        elif config.moe.shared_experts:
            plan |= mlp_plan(block, inside, "swiglu", mlp="mlp.shared_expert")
    return plan | split_sequence(1, sp) | gpt.vocab_plan(config, parallel)


def check(model: ModelConfig, parallel: ParallelSizes) -> None:
    """The MoE GPT's rules where there are sparse blocks (ep divides the experts, no ZeRO-3 with ep), and
    tp divides the heads and the dense MLPs."""
    config = deepseek_config(model)
    if config.sparse_layers:
        moe_gpt.check(config, parallel)  # with the MTP rules
    else:
        gpt.check_mtp(config, parallel)
    if config.num_heads % parallel.tp:
        raise ConfigError(
            f"parallel.tp={parallel.tp} does not divide model.num_heads={config.num_heads}; "
            f"choose tp in {divisors(config.num_heads)}"
        )
    if config.moe.dense_layers:
        check_mlp_split(config.mlp_width, parallel.tp)


SPEC = ModelSpec(
    kind="deepseek-v3",
    config=DeepSeekV3Config,
    presets=PRESETS,
    sequence_length=gpt.sequence_length,
    output_width=gpt.vocab_size,
    task="language",
    build=build,
    tp_plan=tp_plan,
    has_experts=True,
    tied=gpt.tied,
    check=check,
    context_parallel=True,
    hf_families=(DEEPSEEK_V3, DEEPSEEK_V2),
)
