"""A mixture-of-experts layer's settings, one class for both uses: ``[model.moe]`` in a config, and the
settings of a :class:`polyshard.models.common.moe.MoELayer` built by hand (which is given the model's
width ``hidden`` beside them). What the model around the layer adds (shared experts, dense blocks, the
selection bias's balancing rate) is here too; the layer ignores it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from polyshard.mesh import divisors
from polyshard.models.common.moe.router import SCORES
from polyshard.models.errors import ConfigError, MoEConfigError, check_at_least, check_positive

ACTIVATIONS = ("swiglu", "gelu", "clamped-swiglu")
MAX_EXPERTS = 1 << 16  # model.moe.num_experts at most: open MoEs route among 8 to a few hundred (Kimi K2: 384)


@dataclass(kw_only=True, frozen=True)
class MoEConfig:
    """``[model.moe]``: the routed experts, their router and losses, and the shared and dense MLPs beside
    them; validated on construction (every error a :class:`MoEConfigError` naming ``model.moe``'s field)."""

    num_experts: int = 4
    """Routed experts per MoE layer (E)."""
    top_k: int = 2
    """Experts each token is routed to."""
    ffn_hidden: int | None = None
    """Width of each routed expert's MLP; None means the model's MLP width / top_k, about a dense MLP's
    active FLOPs (Hugging Face's moe_intermediate_size; Mixtral's intermediate_size). A layer built by
    hand is given it beside these settings when None."""
    renormalize: bool = True
    """Rescale each token's top-k router weights to sum to 1 (Mixtral; Hugging Face's norm_topk_prob);
    false keeps their softmax values (Qwen2-MoE)."""
    score: str = "softmax"
    """Router scores: softmax (Mixtral, Qwen-MoE), sigmoid (DeepSeek-V3: the chosen experts' affinities
    normalised, with a per-expert bias that only selects, see bias_update_rate) or topk-softmax (gpt-oss:
    the k largest logits chosen, their weights a softmax over those k; renormalize changes nothing)."""
    router_bias: bool = False
    """A learned bias on the router's logits (gpt-oss)."""
    activation: str = "swiglu"
    """The experts' MLP: swiglu (Mixtral, Qwen, DeepSeek), gelu, or clamped-swiglu (gpt-oss: gate and up
    clamped at swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate))."""
    swiglu_alpha: float = 1.702
    """With activation = clamped-swiglu: the sigmoid's gain (gpt-oss: 1.702)."""
    swiglu_limit: float = 7.0
    """With activation = clamped-swiglu: the clamp on gate (above) and up (both sides) (gpt-oss: 7)."""
    expert_bias: bool = False
    """Biases on each routed expert's first and last matrices (gpt-oss)."""
    groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts split into this many equal groups; 1 is off."""
    group_topk: int = 1
    """With groups > 1: each token chooses among the experts of its best this-many groups (topk_group)."""
    scale: float = 1.0
    """Factor on the chosen experts' weights (DeepSeek-V3's routed_scaling_factor, 2.5 there)."""
    capacity_factor: float | None = None
    """None for dropless routing; otherwise tokens beyond capacity are dropped."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch/GShard load-balancing loss, on each data rank's tokens."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss (ST-MoE): mean squared logsumexp of the router logits."""
    seq_aux_loss_coef: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss, per sequence (DeepSeek-V3 uses 0.0001)."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (score = sigmoid; DeepSeek-V3 uses 0.001): after every optimizer step
    each expert's selection bias moves by this toward balance, from the step's load over all tokens; 0 keeps
    the bias as it is."""
    shared_experts: int = 0
    """Shared experts: a dense SwiGLU MLP of width shared_experts x shared_ffn_hidden that every token
    passes through beside its routed experts (Qwen2-MoE: 1, DeepSeek-V3: 1); 0 for none."""
    shared_ffn_hidden: int | None = None
    """Width of one shared expert; None means the routed experts' width."""
    shared_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(x . w), w one learned vector (Qwen2-MoE)."""
    dense_layers: list[int] = field(default_factory=list, hash=False)  # a list (TOML's); configs key caches
    """Blocks (0-based) that keep a dense MLP instead of experts: DeepSeek's first_k_dense_replace first
    blocks, Qwen-MoE's mlp_only_layers and decoder_sparse_step; empty: every block is sparse."""
    dense_ffn_hidden: int | None = None
    """Width of the dense blocks' MLP; None means the model's MLP width (Hugging Face's intermediate_size)."""

    def __post_init__(self) -> None:
        try:
            self._check_settings()  # their messages name model.moe.<field>
        except ConfigError as err:  # the shared checks' type, narrowed to this section's
            raise MoEConfigError(str(err)) from None
        try:
            self._check_layer()
        except MoEConfigError as err:
            raise MoEConfigError(f"model.moe: {err}") from None

    def _check_settings(self) -> None:
        for name in ("num_experts", "top_k"):
            check_positive(f"model.moe.{name}", getattr(self, name))
        if self.num_experts > MAX_EXPERTS:  # per-expert names, routing tables: 1e9 exhausts memory before launch
            raise ConfigError(
                f"model.moe.num_experts={self.num_experts} is past {MAX_EXPERTS:,}, far more than any MoE trains "
                "(DeepSeek-V3 has 256); set the real count, e.g. --set model.moe.num_experts=64"
            )
        for name in ("ffn_hidden", "shared_ffn_hidden", "dense_ffn_hidden"):
            if getattr(self, name) is not None:
                check_positive(f"model.moe.{name}", getattr(self, name))
        check_at_least("model.moe.shared_experts", self.shared_experts, 0)
        self._check_dense_layers()
        check_at_least("model.moe.bias_update_rate", self.bias_update_rate, 0.0)
        if self.shared_gate and not self.shared_experts:
            raise ConfigError("model.moe.shared_gate gates the shared experts: set model.moe.shared_experts >= 1")
        if self.bias_update_rate > 0 and self.score != "sigmoid":
            raise ConfigError(
                f"model.moe.bias_update_rate={self.bias_update_rate} balances a sigmoid router's selection bias, "
                f"but model.moe.score={self.score!r}; set score='sigmoid' or bias_update_rate=0"
            )

    def _check_dense_layers(self) -> None:
        dense = self.dense_layers
        if (
            not isinstance(dense, list)
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in dense)
            or len(set(dense)) != len(dense)
        ):
            raise ConfigError(
                f"model.moe.dense_layers={dense!r} must be a list of distinct block indices >= 0 (0 is the first "
                "block), e.g. [0] for a dense first block"
            )

    def _check_layer(self) -> None:
        if self.top_k > self.num_experts:
            raise MoEConfigError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}: a token cannot visit more "
                f"experts than exist; choose top_k in 1..{self.num_experts}"
            )
        if self.activation not in ACTIVATIONS:
            raise MoEConfigError(f"activation={self.activation!r} is unknown; choose one of {ACTIVATIONS}")
        if not (math.isfinite(self.swiglu_alpha) and self.swiglu_alpha > 0):
            raise MoEConfigError(f"swiglu_alpha={self.swiglu_alpha} must be a finite number > 0 (gpt-oss: 1.702)")
        if not (math.isfinite(self.swiglu_limit) and self.swiglu_limit > 0):
            raise MoEConfigError(f"swiglu_limit={self.swiglu_limit} must be a finite number > 0 (gpt-oss: 7.0)")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise MoEConfigError(
                f"capacity_factor={self.capacity_factor} must be > 0 (e.g. 1.25), or None for dropless routing"
            )
        if min(self.aux_loss_coef, self.z_loss_coef, self.seq_aux_loss_coef) < 0:
            raise MoEConfigError(
                f"loss coefficients must be >= 0, got aux_loss_coef={self.aux_loss_coef}, "
                f"z_loss_coef={self.z_loss_coef}, seq_aux_loss_coef={self.seq_aux_loss_coef}; use 0 to turn a loss off"
            )
        self._check_routing()

    def _check_routing(self) -> None:
        if self.score not in SCORES:
            raise MoEConfigError(f"score={self.score!r} is unknown; choose one of {SCORES}")
        if not self.scale > 0:
            raise MoEConfigError(f"scale={self.scale} must be > 0 (1 leaves the routing weights as they are)")
        if self.groups < 1 or self.num_experts % self.groups:
            raise MoEConfigError(
                f"groups={self.groups} must divide num_experts={self.num_experts} into equal groups; "
                f"choose groups in {divisors(self.num_experts)} (1 turns group-limited routing off)"
            )
        if self.score == "topk-softmax" and self.groups > 1:
            raise MoEConfigError(
                f"groups={self.groups} limits routing to groups by their scores, which score='topk-softmax' does "
                "not compute over every expert; set groups=1 or score='softmax'/'sigmoid'"
            )
        if not 1 <= self.group_topk <= self.groups:
            raise MoEConfigError(f"group_topk={self.group_topk} must be between 1 and groups={self.groups}")
        reachable = self.group_topk * (self.num_experts // self.groups)
        if self.top_k > reachable:
            raise MoEConfigError(
                f"top_k={self.top_k} exceeds the {reachable} experts in group_topk={self.group_topk} groups of "
                f"{self.num_experts // self.groups}; raise group_topk or lower top_k"
            )

    def expert_width(self, mlp_width: int) -> int:
        """Width of each routed expert: ffn_hidden, or the dense MLP's width / top_k when unset."""
        return self.ffn_hidden or max(1, mlp_width // self.top_k)

    def shared_width(self, mlp_width: int) -> int:
        """Width of the shared experts' one MLP: shared_experts x one's width; 0 without them."""
        return self.shared_experts * (self.shared_ffn_hidden or self.expert_width(mlp_width))
