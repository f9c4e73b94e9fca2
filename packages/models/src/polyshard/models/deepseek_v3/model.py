"""DeepSeek-V3 / V2 as plain PyTorch: the GPT's layers (embedding, blocks, head) with multi-head latent
attention in every block (:class:`polyshard.models.common.mla.MLA`), a dense SwiGLU MLP in the
``moe.dense_layers`` blocks (the first ones) and an MoE layer (sigmoid, group-limited routing with a selection bias and
shared experts, :class:`polyshard.models.moe_gpt.model.MoEMLP`) in the others."""

from __future__ import annotations

from typing import cast

from polyshard.models.common.mla import MLA
from polyshard.models.common.mtp import PredictionDepth
from polyshard.models.config import ModelConfig
from polyshard.models.decoder import LatentAttention, decoder_shape
from polyshard.models.deepseek_v3.config import DeepSeekV3Config
from polyshard.models.deepseek_v3.hf import DEEPSEEK_V2, DEEPSEEK_V3
from polyshard.models.deepseek_v3.plan import check, deepseek, tp_plan
from polyshard.models.deepseek_v3.presets import PRESETS
from polyshard.models.gpt import model as gpt
from polyshard.models.moe_gpt import model as moe_gpt
from polyshard.models.spec import (
    BuildOptions,
    ModelSpec,
)


def mla(config: LatentAttention) -> MLA:
    """One block's attention."""
    return MLA(
        config.hidden,
        config.num_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rope=config.rope,
        softmax_scale=config.softmax_scale,
        norm_eps=1e-6,  # the latents' norms keep DeepSeek's epsilon whatever rms_norm_eps says (as transformers)
        bias=config.attention_bias,
        interleaved=config.rope_interleave,
        core=config.attention_core,
    )


def build(config: ModelConfig, options: BuildOptions) -> gpt.GPT:
    """The GPT's layers with MLA in each block, MoE MLPs in the sparse ones (:meth:`~DeepSeekV3Config.sparse_layer`)."""
    config = deepseek(config)
    model = gpt.build_decoder(config, options, attention={})  # each block's attention is replaced by MLA
    head = cast(gpt.LMHead, model.layers[-1])
    depths = [cast(PredictionDepth, depth).block for depth in head.mtp.depths] if head.mtp is not None else []
    for i, block in enumerate([*model.layers[1:-1], *depths]):  # a prediction depth's block is like the last
        block.attn = mla(config)
        if config.sparse_layer(min(i, config.num_layers - 1)):
            block.mlp = moe_gpt.MoEMLP(
                config.moe,
                hidden=config.hidden,
                ffn_hidden=config.expert_width,
                aux_loss_scale=options.aux_loss_scale,
                shared_hidden=config.shared_width,
            )
    return model


SPEC = ModelSpec(
    shape=decoder_shape,
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
    hf_adapters=(DEEPSEEK_V3, DEEPSEEK_V2),
)
