"""How DeepSeek-V3 splits: multi-head latent attention's heads over tp (the latent projections
replicated), the MoE GPT's experts and vocabulary plans; and the layouts it cannot run."""

from __future__ import annotations

from polyshard.mesh import divisors
from polyshard.models.config import ModelConfig
from polyshard.models.decoder import LatentAttention
from polyshard.models.deepseek_v3.config import DeepSeekV3Config
from polyshard.models.errors import ConfigError
from polyshard.models.gpt import plan as gpt_plan
from polyshard.models.moe_gpt import plan as moe_gpt_plan
from polyshard.models.spec import (
    ParallelSizes,
    check_mlp_split,
    mlp_plan,
    sequence_plan,
    split_sequence,
)
from polyshard.tp import ColumnParallel, HeadNorm, RowParallel, TPEntry


def deepseek(model: ModelConfig) -> DeepSeekV3Config:
    """``model`` as DeepSeek's settings (the spec's functions are declared over every family's)."""
    if not isinstance(model, DeepSeekV3Config):
        raise ConfigError(f"model.kind={model.kind!r} is not DeepSeek's; this needs model.kind='deepseek-v3'")
    return model


def mla_plan(block: str, config: LatentAttention, sp: bool) -> dict[str, object]:
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
    config = deepseek(model)
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
    return plan | split_sequence(1, sp) | gpt_plan.vocab_plan(config, parallel)


def check(model: ModelConfig, parallel: ParallelSizes) -> None:
    """The MoE GPT's rules where there are sparse blocks (ep divides the experts, no ZeRO-3 with ep), and
    tp divides the heads and the dense MLPs."""
    config = deepseek(model)
    if config.sparse_layers:
        moe_gpt_plan.check(config, parallel)  # with the MTP rules
    else:
        gpt_plan.check_mtp(config, parallel)
    if config.num_heads % parallel.tp:
        raise ConfigError(
            f"parallel.tp={parallel.tp} does not divide model.num_heads={config.num_heads}; "
            f"choose tp in {divisors(config.num_heads)}"
        )
    if config.moe.dense_layers:
        check_mlp_split(config.mlp_width, parallel.tp)
