"""The settings: one frozen dataclass per ``[section]`` of a config, each field documented by the line
under it and checked for its own range when built (``__post_init__``). Constraints between
fields and sections are :func:`polyshard.trainer.engine.constraints.validate`'s; a model family's
own constraints are its spec's (:func:`polyshard.trainer.models.check_model`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from polyshard.mesh import divisors
from polyshard.trainer.errors import ConfigError

# Llama's architecture on the GPT: RMSNorm, SwiGLU, rotary positions, no biases.
LLAMA: dict[str, Any] = {"norm": "rms", "activation": "swiglu", "positions": "rope", "bias": False}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"hidden": 64, "num_layers": 4, "num_heads": 4, "context_length": 64},
    "small": {"hidden": 256, "num_layers": 6, "num_heads": 8, "context_length": 256},
    "gpt2-124m": {"hidden": 768, "num_layers": 12, "num_heads": 12, "context_length": 1024, "vocab_size": 50257},
    "llama-tiny": {
        **LLAMA, "hidden": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "context_length": 64,
        "mlp_hidden": 176,
    },
    "llama-3.2-1b": {
        **LLAMA, "hidden": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "context_length": 8192,
        "mlp_hidden": 8192, "vocab_size": 128256, "rope_theta": 500000.0, "tie_embeddings": True, "norm_eps": 1e-5,
        "rope_scale_factor": 32.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
        "rope_original_context": 8192,
    },
    "llama-3-8b": {
        **LLAMA, "hidden": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "context_length": 8192,
        "mlp_hidden": 14336, "vocab_size": 128256, "rope_theta": 500000.0, "norm_eps": 1e-5,
    },
    # Qwen3: Llama's architecture with q/k norms and 128-dim heads at every width.
    "qwen3-tiny": {
        **LLAMA, "qk_norm": True, "hidden": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
        "context_length": 64, "mlp_hidden": 176, "norm_eps": 1e-6, "tie_embeddings": True,
    },
    "qwen3-8b": {
        **LLAMA, "qk_norm": True, "hidden": 4096, "num_layers": 36, "num_heads": 32, "num_kv_heads": 8,
        "head_dim": 128, "context_length": 40960, "mlp_hidden": 12288, "vocab_size": 151936, "rope_theta": 1e6,
        "norm_eps": 1e-6,
    },
    # Mixture-of-experts families (model.kind = "moe-gpt"): every block's MLP is routed experts.
    "mixtral-tiny": {
        **LLAMA, "kind": "moe-gpt", "hidden": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
        "context_length": 64, "num_experts": 4, "top_k": 2, "expert_hidden": 96, "rope_theta": 1e6,
    },
    "mixtral-8x7b": {
        **LLAMA, "kind": "moe-gpt", "hidden": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
        "context_length": 32768, "vocab_size": 32000, "num_experts": 8, "top_k": 2, "expert_hidden": 14336,
        "rope_theta": 1e6,
    },
    "qwen3-moe-tiny": {
        **LLAMA, "kind": "moe-gpt", "qk_norm": True, "hidden": 64, "num_layers": 4, "num_heads": 4,
        "num_kv_heads": 2, "context_length": 64, "num_experts": 8, "top_k": 2, "expert_hidden": 32, "norm_eps": 1e-6,
    },
    "qwen3-30b-a3b": {
        **LLAMA, "kind": "moe-gpt", "qk_norm": True, "hidden": 2048, "num_layers": 48, "num_heads": 32,
        "num_kv_heads": 4, "head_dim": 128, "context_length": 40960, "vocab_size": 151936, "num_experts": 128,
        "top_k": 8, "expert_hidden": 768, "rope_theta": 1e6, "norm_eps": 1e-6,
    },
    "qwen2-moe-tiny": {
        **LLAMA, "kind": "moe-gpt", "qkv_bias": True, "hidden": 64, "num_layers": 4, "num_heads": 4,
        "context_length": 64, "num_experts": 8, "top_k": 2, "expert_hidden": 32, "shared_experts": 1,
        "shared_expert_hidden": 128, "shared_expert_gate": True, "router_renormalize": False, "norm_eps": 1e-6,
    },
}  # fmt: skip
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
V_SCHEDULES = ("zb-v", "dualpipev")  # two stages per pipeline rank in a V: virtual_stages = 2
SPLIT_BACKWARD = ("zb-h1", "zb-v", "dualpipev")  # backward split into B (input gradient) and W (weights)
MESH_AXES = ("pp", "dp", "ep", "cp", "tp")  # outermost first: tp fastest, so its ranks are neighbours
PRECISIONS = ("fp32", "bf16")
CHECKPOINTING = (False, "selective", "full")  # training.activation_checkpointing, least recompute first
SCHEDULE_KINDS = ("cosine", "linear", "constant", "wsd")  # the learning rate after warmup
DECAY_SHAPES = ("linear", "cosine", "sqrt")
OPTIMIZERS = ("adamw", "muon")
INIT_RULES = ("gpt2", "depth")
ADAMW_IMPLS = ("auto", "foreach", "fused", "for-loop")  # torch.optim.AdamW's kernels
DECAYED_PARAMS = ("matrices", "all")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    kind: str = "gpt"
    """gpt (decoder-only language model), moe-gpt (its mixture-of-experts variant) or vit (image classifier)."""
    preset: str | None = None
    """Sets the sizes (and for Llama, Qwen and Mixtral the architecture below, and kind): tiny, small, gpt2-124m,
    llama-tiny, llama-3.2-1b, llama-3-8b, qwen3-tiny, qwen3-8b, mixtral-tiny, mixtral-8x7b, qwen3-moe-tiny,
    qwen3-30b-a3b or qwen2-moe-tiny; keys given here win."""
    vocab_size: int = 256
    """Tokens in the vocabulary; 256 for the byte-level tokenizer."""
    context_length: int = 64
    """Tokens per sequence (gpt) — the packing length."""
    hidden: int = 64
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Query heads per attention layer."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means num_heads."""
    mlp_ratio: int = 4
    """MLP hidden width = mlp_ratio x hidden."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head."""
    dropout: float = 0.0
    """Dropout probability on attention and MLP outputs."""
    norm: str = "layer"
    """layer (LayerNorm, GPT-2) or rms (RMSNorm, Llama)."""
    activation: str = "gelu"
    """The MLP: gelu (GPT-2's tanh GELU) or swiglu (Llama's gated SiLU, three matrices)."""
    positions: str = "learned"
    """learned (a position table, GPT-2) or rope (rotary embeddings on q and k, Llama)."""
    bias: bool = True
    """Biases in the attention and MLP projections (GPT-2 has them, Llama not)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (positions = rope); Llama 3 uses 500000."""
    rope_scale_factor: float = 1.0
    """Llama 3.1's rotary frequency scaling (Hugging Face rope_type "llama3"): frequencies with wavelengths
    above rope_original_context / rope_low_freq_factor are divided by this; 1 means no scaling (Llama 3.2: 32)."""
    rope_low_freq_factor: float = 1.0
    """With rope scaling: wavelengths above rope_original_context / this are scaled fully."""
    rope_high_freq_factor: float = 4.0
    """With rope scaling: wavelengths below rope_original_context / this are kept; those between are blended."""
    rope_original_context: int = 8192
    """With rope scaling: the context length the model was first trained on (Llama 3: 8192)."""
    norm_eps: float = 1e-5
    """Epsilon of every norm (LayerNorm or RMSNorm, blocks and head); Llama 2 uses 1e-6."""
    mlp_hidden: int | None = None
    """MLP width; None means mlp_ratio x hidden (Llama's intermediate_size)."""
    head_dim: int | None = None
    """Dims of each attention head; None means hidden / num_heads (Qwen3 uses 128 at every width)."""
    qkv_bias: bool | None = None
    """Biases on the q, k and v projections; None follows bias (Qwen2 has them, but none on o or the MLP)."""
    qk_norm: bool = False
    """An RMSNorm over each head's q and k, before rotary positions (Qwen3); its weight is per head dim."""
    num_experts: int = 4
    """Experts per MoE layer (moe-gpt)."""
    top_k: int = 2
    """Experts each token is routed to (moe-gpt)."""
    capacity_factor: float | None = None
    """None for dropless routing; otherwise tokens beyond capacity are dropped (moe-gpt)."""
    aux_loss_weight: float = 0.01
    """Weight of the Switch/GShard load-balancing loss, on each data rank's tokens (moe-gpt)."""
    expert_hidden: int | None = None
    """Width of each routed expert's MLP (moe-gpt); None means the MLP width / top_k, about a dense MLP's
    active FLOPs (Hugging Face's moe_intermediate_size; Mixtral's intermediate_size)."""
    router_renormalize: bool = True
    """Rescale each token's top-k router weights to sum to 1 (Mixtral; Hugging Face's norm_topk_prob);
    false keeps their softmax values (Qwen2-MoE, and Qwen3-MoE configured so) (moe-gpt)."""
    shared_experts: int = 0
    """Shared experts (moe-gpt): a dense SwiGLU MLP of width shared_experts x shared_expert_hidden that
    every token passes through beside its routed experts (Qwen2-MoE: 1, DeepSeek-V3: 1); 0 for none."""
    shared_expert_hidden: int | None = None
    """Width of one shared expert; None means the routed experts' width (moe-gpt)."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(x . w), w one learned vector (Qwen2-MoE)."""
    router: str = "softmax"
    """Router scores (moe-gpt): softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3: the chosen experts'
    affinities normalised, with a per-expert bias that only selects, see router_bias_update_rate)."""
    router_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (router = sigmoid; DeepSeek-V3 uses 0.001): after every optimizer step
    each expert's selection bias moves by this toward balance, from the step's load over all tokens; 0 keeps
    the bias as it is."""
    router_groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts split into this many equal groups; 1 is off."""
    router_group_topk: int = 1
    """With router_groups > 1: each token chooses among the experts of its best this-many groups (topk_group)."""
    router_scale: float = 1.0
    """Factor on the chosen experts' weights (DeepSeek-V3's routed_scaling_factor, 2.5 there)."""
    seq_aux_loss_weight: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss, per sequence (moe-gpt; DeepSeek-V3 uses 0.0001)."""
    router_z_loss_weight: float = 0.0
    """Weight of the router z-loss (ST-MoE): mean squared logsumexp of the router logits (moe-gpt)."""
    image_size: int = 8
    """Side of the square input image (vit)."""
    patch_size: int = 2
    """Side of a square patch (vit)."""
    channels: int = 1
    """Input channels (vit)."""
    num_classes: int = 10
    """Output classes (vit)."""
    init: str | None = None
    """The initial weights: 'gpt2' (N(0, 0.02), output projections / sqrt(2 x layers)) or 'depth'
    (torchtitan's and Megatron's for Llama: embedding N(0, 1), each block's output projections
    0.02 / sqrt(2 x its depth), the head hidden^-0.5; truncated normals; language models only). None:
    'depth' for RMSNorm (Llama-like) language models, 'gpt2' for the others."""

    def __post_init__(self) -> None:
        # model.kind and each family's own constraints are the family's to check (models.check_model).
        if self.preset is not None:
            _check_choice("model.preset", self.preset, list(PRESETS))
        sizes = ("vocab_size", "context_length", "hidden", "num_layers", "num_heads", "mlp_ratio", "num_experts")
        for name in (*sizes, "top_k", "image_size", "patch_size", "channels", "num_classes"):
            _check_positive(f"model.{name}", getattr(self, name))
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(
                f"model.capacity_factor={self.capacity_factor} must be > 0 (e.g. 1.25), or unset for dropless"
            )
        self._check_routing()
        for name in ("head_dim", "expert_hidden", "shared_expert_hidden"):
            if getattr(self, name) is not None:
                _check_positive(f"model.{name}", getattr(self, name))
        _check_at_least("model.shared_experts", self.shared_experts, 0)
        if self.shared_expert_gate and not self.shared_experts:
            raise ConfigError("model.shared_expert_gate gates the shared experts: set model.shared_experts >= 1")
        if self.head_dim is None and self.hidden % self.num_heads:
            raise ConfigError(
                f"model.hidden={self.hidden} is not a multiple of model.num_heads={self.num_heads}; "
                f"choose num_heads in {divisors(self.hidden)}"
            )
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads} must divide model.num_heads={self.num_heads}; "
                f"choose one of {divisors(self.num_heads)}"
            )
        _check_choice("model.norm", self.norm, ("layer", "rms"))
        _check_choice("model.activation", self.activation, ("gelu", "swiglu"))
        _check_choice("model.positions", self.positions, ("learned", "rope"))
        if self.init is not None:
            _check_choice("model.init", self.init, INIT_RULES)
        if not self.rope_theta > 0:
            raise ConfigError(f"model.rope_theta={self.rope_theta} must be > 0 (10000, or 500000 for Llama 3)")
        self._check_rope_scaling()
        if not 0.0 < self.norm_eps < 1.0:
            raise ConfigError(f"model.norm_eps={self.norm_eps} must be in (0, 1) (1e-5; Llama 2 uses 1e-6)")
        if self.positions == "rope" and self.attention_head_dim % 2:
            raise ConfigError(
                f"model.positions='rope' rotates pairs of dims: the head dim (model.head_dim, or hidden/num_heads)="
                f"{self.attention_head_dim} must be even"
            )
        if self.mlp_hidden is not None:
            _check_positive("model.mlp_hidden", self.mlp_hidden)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")

    def _check_routing(self) -> None:
        for name in ("aux_loss_weight", "seq_aux_loss_weight", "router_z_loss_weight", "router_bias_update_rate"):
            _check_at_least(f"model.{name}", getattr(self, name), 0.0)
        _check_choice("model.router", self.router, ("softmax", "sigmoid"))
        if self.router_bias_update_rate > 0 and self.router != "sigmoid":
            raise ConfigError(
                f"model.router_bias_update_rate={self.router_bias_update_rate} balances a sigmoid router's selection "
                f"bias, but model.router={self.router!r}; set router='sigmoid' or router_bias_update_rate=0"
            )
        if not 0.0 < self.router_scale < math.inf:
            raise ConfigError(f"model.router_scale={self.router_scale} must be > 0 (1 leaves the weights as they are)")
        _check_positive("model.router_groups", self.router_groups)
        if self.num_experts % self.router_groups:
            raise ConfigError(
                f"model.router_groups={self.router_groups} must divide model.num_experts={self.num_experts}; "
                f"choose router_groups in {divisors(self.num_experts)}"
            )
        if not 1 <= self.router_group_topk <= self.router_groups:
            raise ConfigError(
                f"model.router_group_topk={self.router_group_topk} must be between 1 and model.router_groups="
                f"{self.router_groups}"
            )
        reachable = self.router_group_topk * (self.num_experts // self.router_groups)
        if self.router_groups > 1 and self.top_k > reachable:
            raise ConfigError(
                f"model.top_k={self.top_k} exceeds the {reachable} experts of model.router_group_topk="
                f"{self.router_group_topk} groups of {self.num_experts // self.router_groups}; raise "
                f"router_group_topk or lower top_k"
            )

    def _check_rope_scaling(self) -> None:
        if not 1.0 <= self.rope_scale_factor < math.inf:
            raise ConfigError(
                f"model.rope_scale_factor={self.rope_scale_factor} must be >= 1 (1: no scaling; Llama 3.2 uses 32)"
            )
        if not 0.0 < self.rope_low_freq_factor < self.rope_high_freq_factor < math.inf:
            raise ConfigError(
                f"model.rope_low_freq_factor={self.rope_low_freq_factor} and model.rope_high_freq_factor="
                f"{self.rope_high_freq_factor} need 0 < low < high (Llama 3 uses 1 and 4)"
            )
        _check_positive("model.rope_original_context", self.rope_original_context)
        if self.rope_scale_factor != 1.0 and self.positions != "rope":
            raise ConfigError(
                f"model.rope_scale_factor={self.rope_scale_factor} scales rotary positions, but model.positions="
                f"{self.positions!r}; set positions='rope' or rope_scale_factor=1"
            )

    @property
    def init_rule(self) -> str:
        """The initialisation rule: ``init``, or by the architecture when unset (see ``init``)."""
        return self.init or ("depth" if self.norm == "rms" and self.kind != "vit" else "gpt2")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def mlp_width(self) -> int:
        return self.mlp_hidden or self.mlp_ratio * self.hidden

    @property
    def attention_head_dim(self) -> int:
        """Dims per attention head: head_dim, or hidden / num_heads when unset."""
        return self.head_dim or self.hidden // self.num_heads

    @property
    def qkv_biased(self) -> bool:
        """Whether q, k and v have biases: qkv_bias, or bias when unset."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def expert_width(self) -> int:
        """Width of each routed expert (moe-gpt): expert_hidden, or the MLP width / top_k when unset."""
        return self.expert_hidden or max(1, self.mlp_width // self.top_k)

    @property
    def shared_width(self) -> int:
        """Width of the shared experts' one MLP (moe-gpt): shared_experts x one's width; 0 without them."""
        return self.shared_experts * (self.shared_expert_hidden or self.expert_width)


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
    ranks, overlapped with compute) or 'allgather' (gathered once per layer; Llama 3's choice for GQA)."""
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
        _check_choice("parallel.cp_style", self.cp_style, ("ring", "allgather"))
        _check_choice("parallel.schedule", self.schedule, SCHEDULES)
        if not self.timeout_s > 0:
            raise ConfigError(f"parallel.timeout_s={self.timeout_s} must be > 0 seconds (default 600)")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero_stage={self.zero_stage}; choose 0, 1, 2 or 3")
        self._check_dp_shard()
        if self.stage_layers is not None and (
            not isinstance(self.stage_layers, list) or not all(isinstance(n, int) and n >= 1 for n in self.stage_layers)
        ):
            raise ConfigError(f"parallel.stage_layers={self.stage_layers!r} must be a list of layer counts >= 1")
        if self.schedule in V_SCHEDULES and self.virtual_stages != 2:
            raise ConfigError(
                f"parallel.schedule={self.schedule!r} puts two stages on each pipeline rank (a V); "
                f"set parallel.virtual_stages=2 (got {self.virtual_stages})"
            )
        if self.virtual_stages > 1 and self.schedule not in ("interleaved", *V_SCHEDULES):
            raise ConfigError(
                f"parallel.virtual_stages={self.virtual_stages} needs parallel.schedule='interleaved' "
                f"(or 'zb-v' / 'dualpipev' with 2; got {self.schedule!r}); set virtual_stages=1 or switch the schedule"
            )

    def _check_dp_shard(self) -> None:
        if self.dp_shard is None:
            return
        _check_positive("parallel.dp_shard", self.dp_shard)
        if isinstance(self.dp, int) and self.dp % self.dp_shard:
            raise ConfigError(
                f"parallel.dp_shard={self.dp_shard} must divide parallel.dp={self.dp}; "
                f"choose dp_shard in {divisors(self.dp)}"
            )
        if self.dp_shard == self.dp:  # sharding over all of dp: one spelling of it, None
            object.__setattr__(self, "dp_shard", None)
            return
        if self.hybrid and self.zero_stage == 0:
            raise ConfigError(
                f"parallel.dp_shard={self.dp_shard} (hybrid sharding) needs parallel.zero_stage 1, 2 or 3: "
                "at stage 0 nothing is sharded; set zero_stage or remove dp_shard"
            )

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
    steps: int = 100
    """Optimizer steps."""
    global_batch_size: int = 16
    """Sequences (or images) per optimizer step, over all data ranks and microbatches."""
    optimizer: str = "adamw"
    """'adamw', or 'muon': Newton-Schulz orthogonalised momentum for the blocks' weight matrices (experts'
    one by one) with Moonlight's 0.2 * sqrt(max(m, n)) update scale, so `lr` and `weight_decay` carry
    over from AdamW; AdamW (`beta1`, `beta2`) for embeddings, head, norms, biases and routers. Each
    matrix is orthogonalised whole, on one rank of those holding its tp/ZeRO pieces."""
    muon_momentum: float = 0.95
    """optimizer = 'muon': the momentum of the matrices' buffer."""
    muon_nesterov: bool = True
    """optimizer = 'muon': orthogonalise the Nesterov look-ahead (gradient + momentum x buffer) rather
    than the buffer."""
    muon_ns_steps: int = 5
    """optimizer = 'muon': Newton-Schulz iterations (5 with the usual quintic coefficients)."""
    lr: float = 1e-3
    """Peak learning rate (of AdamW; Muon's matrices scale it by their shape)."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay."""
    warmup_steps: int = 10
    """Linear warmup from 0 to lr."""
    schedule: str = "cosine"
    """After warmup: 'cosine' (cosine decay to min_lr at `steps`), 'linear' (linear decay to min_lr),
    'constant' (lr), or 'wsd' (warmup-stable-decay: lr, then the last `decay_fraction` of the steps decay
    to min_lr in the shape `decay_shape`)."""
    decay_fraction: float = 0.2
    """schedule = 'wsd': the share of `steps` spent decaying, at the end of the run (MiniCPM uses ~0.1-0.2)."""
    decay_shape: str = "linear"
    """schedule = 'wsd': the decay's shape: 'linear', 'cosine' or 'sqrt' (1 - sqrt of the decay's progress)."""
    weight_decay: float = 0.1
    """AdamW weight decay, on the parameters `weight_decay_params` names."""
    weight_decay_params: str = "matrices"
    """Which parameters decay: 'matrices' (GPT-2, nanoGPT: not norms, biases or embeddings) or 'all'
    (torchtitan)."""
    adamw_impl: str = "auto"
    """AdamW's kernel (torch.optim.AdamW): 'auto' (torch's choice: foreach), 'foreach' (one kernel per op over
    all tensors), 'fused' (one kernel for the whole step; CPU and CUDA) or 'for-loop' (tensor by tensor)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
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
    eval_every: int = 50
    """Evaluate on the validation split every N steps (0 disables)."""
    eval_batches: int = 4
    """Global batches per evaluation, from the start of the validation split; 0 evaluates all of it."""
    sample_tokens: int = 200
    """Tokens of text to sample from the GPT at the end (0 disables)."""
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
    consistency_every: int = 100
    """Every N steps (and before each checkpoint) check that data-parallel replicas hold bitwise equal
    parameters: one all-gather of a checksum per rank; a replica that drifted stops the run (0 disables)."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size"):
            _check_positive(f"training.{name}", getattr(self, name))
        _check_choice("training.precision", self.precision, PRECISIONS)
        if isinstance(self.activation_checkpointing, bool):  # true, in older configs and checkpoints: full
            object.__setattr__(self, "activation_checkpointing", "full" if self.activation_checkpointing else False)
        _check_choice("training.activation_checkpointing", self.activation_checkpointing, CHECKPOINTING)
        _check_choice("training.on_nonfinite", self.on_nonfinite, ("skip", "stop"))
        _check_choice("training.schedule", self.schedule, SCHEDULE_KINDS)
        _check_choice("training.decay_shape", self.decay_shape, DECAY_SHAPES)
        _check_choice("training.optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("training.adamw_impl", self.adamw_impl, ADAMW_IMPLS)
        _check_choice("training.weight_decay_params", self.weight_decay_params, DECAYED_PARAMS)
        if not isinstance(self.loss_chunks, int) or isinstance(self.loss_chunks, bool) or self.loss_chunks < 0:
            raise ConfigError(f"training.loss_chunks={self.loss_chunks!r} must be an integer >= 0 (0 or 1: off)")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"training.muon_momentum={self.muon_momentum} must be in [0, 1) (Muon uses 0.95)")
        _check_positive("training.muon_ns_steps", self.muon_ns_steps)
        if not isinstance(self.muon_nesterov, bool):
            raise ConfigError(f"training.muon_nesterov={self.muon_nesterov!r} must be true or false")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(
                f"training.decay_fraction={self.decay_fraction} must be in (0, 1] (e.g. 0.2: the last 20%)"
            )
        if self.schedule == "wsd" and self.warmup_steps > self.steps - self.decay_steps:
            raise ConfigError(
                f"training.warmup_steps={self.warmup_steps} overlaps the decay, which starts at step "
                f"{self.steps - self.decay_steps} (decay_fraction={self.decay_fraction} of steps={self.steps}); "
                "warm up for fewer steps or decay over a smaller fraction"
            )
        _check_positive("training.nonfinite_patience", self.nonfinite_patience)
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= training.min_lr ({self.min_lr}) <= training.lr ({self.lr}) and lr > 0")
        for name in (
            "warmup_steps",
            "grad_clip",
            "weight_decay",
            "eval_every",
            "eval_batches",
            "sample_tokens",
            "seed",
            "stop_at",
            "consistency_every",
        ):
            _check_at_least(f"training.{name}", getattr(self, name), 0)
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"training.{name}={getattr(self, name)} must be in [0, 1) (AdamW uses 0.9 and 0.95)")
        if self.stop_at > self.steps:
            raise ConfigError(f"training.stop_at={self.stop_at} is past training.steps={self.steps}; give 1..steps")

    @property
    def decay_steps(self) -> int:
        """schedule = 'wsd': the steps at the end of the run spent decaying (at least one)."""
        return max(1, round(self.decay_fraction * self.steps))

    @property
    def last_step(self) -> int:
        """The step this run ends at: `stop_at` when given, else `steps`."""
        return self.stop_at or self.steps


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
    return WeightedSource(path, float(weight))


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    every: int = 0
    """Save every N steps (0: only at the end)."""
    keep: int = 2
    """Complete checkpoints to keep; older ones are deleted."""
    hf_every: int = 0
    """Also write the checkpoint of every N-th step as a Hugging Face folder, <run>/hf/step_<N>, that
    transformers loads (GPT-2 and Llama models; 0: never). N is a multiple of `every`."""
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

    def __post_init__(self) -> None:
        _check_positive("logging.every", self.every)
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"logging.peak_tflops={self.peak_tflops} must be > 0, or unset")
        if self.profile_steps is not None:
            _check_step_range("logging.profile_steps", self.profile_steps)


@dataclass(kw_only=True, frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


# -- helpers -------------------------------------------------------------------
def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")


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


def _check_at_least(name: str, value: float, low: float) -> None:
    if not value >= low:
        raise ConfigError(f"{name}={value!r} must be >= {low}")


def _check_choice(name: str, value: Any, choices: Sequence[object]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}; choose one of {list(choices)}")
