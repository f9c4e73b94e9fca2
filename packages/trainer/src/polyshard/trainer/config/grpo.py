"""The ``[grpo]`` section: reinforcement learning from verifiable rewards with Group Relative Policy
Optimization (DeepSeekMath, 2402.03300) and ``training.task = "grpo"``. Its names are TRL 1.16's
``GRPOConfig``'s where one exists (``num_generations`` is ``generations``, ``num_iterations`` is
``iterations``), with TRL's defaults, so a recipe carries over; the loss is
:mod:`polyshard.trainer.tasks.grpo`'s and the rewards :mod:`polyshard.trainer.tasks.rewards`'.

The reward functions are an array of tables::

    [[grpo.rewards]]
    function = "exact_answer"            # a built-in
    [[grpo.rewards]]
    function = "my_rewards:brevity"      # module:function (or path/to/file.py:function)
    weight = 0.5
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from polyshard.models.errors import ConfigError

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # TRL 1.16's clipped-objective normalisations
SCALE_REWARDS = ("group", "batch", "none")  # TRL 1.16's std scaling of the advantages
BUILTIN_REWARDS = ("exact_answer", "format_regex")  # :mod:`polyshard.trainer.tasks.rewards`' built-ins


@dataclass(frozen=True)
class RewardSpec:
    """One entry of ``[[grpo.rewards]]``: a reward function and its weight in the summed reward."""

    function: str
    """A built-in's name (``exact_answer``, ``format_regex``), ``package.module:function`` (imported), or
    ``path/to/file.py:function`` (a file, relative to the directory the run starts in)."""
    weight: float = 1.0
    """Its factor in the reward: rewards = sum over functions of weight x score (TRL's reward_weights)."""


@dataclass(kw_only=True, frozen=True)
class GRPOConfig:
    generations: int = 8
    """Completions sampled per prompt, a group (TRL's num_generations); advantages compare within it. >= 2."""
    max_completion_length: int = 64
    """Tokens generated at most per completion (dr_grpo's loss divides by it)."""
    temperature: float = 1.0
    """Sampling temperature; the log-probs of the loss are of logits / temperature too, as TRL's."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens whose probabilities add up to top_p (1: all)."""
    top_k: int = 0
    """Draw from the k most likely tokens only (0: no limit)."""
    stop: list[str] = field(default_factory=list)
    """Texts that end a completion (kept in it), besides the tokenizer's end of text."""
    epsilon: float = 0.2
    """Clipping: the probability ratio is kept >= 1 - epsilon (and <= 1 + epsilon_high)."""
    epsilon_high: float | None = None
    """The upper clipping bound's epsilon (DAPO recommends 0.28); None: epsilon."""
    beta: float = 0.0
    """Weight of the KL penalty to the reference (the starting model), k3 estimator per token; 0 (TRL's
    default) keeps no reference."""
    use_bias_correction_kl: bool = True
    """Multiply each token's KL by its probability ratio (TRL 1.16's default, DeepSeek-V3.2's unbiased KL
    gradient): the ratio's gradient changes the KL's even on-policy, where its value is 1. False: the plain k3."""
    loss_type: str = "dapo"
    """How token losses are averaged: 'dapo' over the global batch's completion tokens (TRL 1.16's default);
    'grpo' per completion, then over completions; 'dr_grpo' the sum over completions x max_completion_length;
    'bnpo' over each microbatch's completion tokens."""
    scale_rewards: str = "group"
    """Advantage = reward - its group's mean, divided by the std of the 'group' (TRL's default), of the whole
    'batch', or not at all ('none', Dr. GRPO)."""
    iterations: int = 1
    """Optimizer steps on each generated batch (TRL's num_iterations, mu); beyond the first, the
    probability ratios are against the policy that generated it."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """The reward functions, as [[grpo.rewards]] tables with `function` and `weight`; at least one."""

    def __post_init__(self) -> None:
        _check_int("grpo.generations", self.generations, 2, "e.g. 8 (a group needs two completions to compare)")
        _check_int("grpo.max_completion_length", self.max_completion_length, 1, "e.g. 64")
        _check_number("grpo.temperature", self.temperature, "a number > 0, e.g. 1.0")
        if self.temperature <= 0:
            raise ConfigError(f"grpo.temperature={self.temperature!r} must be > 0, e.g. 1.0 (TRL's default)")
        _check_number("grpo.top_p", self.top_p, "in (0, 1], e.g. 1.0 (every token)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"grpo.top_p={self.top_p!r} must be in (0, 1], e.g. 1.0 (every token)")
        _check_int("grpo.top_k", self.top_k, 0, "0 (no limit) or the tokens to keep, e.g. 50")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f'grpo.stop={self.stop!r} must be a list of non-empty texts, e.g. ["\\n\\n"]')
        _check_number("grpo.epsilon", self.epsilon, "in (0, 1), e.g. 0.2")
        if not 0 < self.epsilon < 1:
            raise ConfigError(f"grpo.epsilon={self.epsilon!r} must be in (0, 1), e.g. 0.2 (TRL's default)")
        if self.epsilon_high is not None:
            _check_number("grpo.epsilon_high", self.epsilon_high, "a number > 0, e.g. 0.28, or unset")
            if self.epsilon_high <= 0:
                raise ConfigError(f"grpo.epsilon_high={self.epsilon_high!r} must be > 0, e.g. 0.28 (DAPO), or unset")
        _check_number("grpo.beta", self.beta, "a number >= 0, e.g. 0.0 or 0.04")
        if self.beta < 0:
            raise ConfigError(f"grpo.beta={self.beta!r} must be >= 0, e.g. 0.0 (no reference) or 0.04")
        if not isinstance(self.use_bias_correction_kl, bool):
            raise ConfigError(f"grpo.use_bias_correction_kl={self.use_bias_correction_kl!r} must be true or false")
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"grpo.loss_type={self.loss_type!r} must be one of {list(LOSS_TYPES)}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ConfigError(f"grpo.scale_rewards={self.scale_rewards!r} must be one of {list(SCALE_REWARDS)}")
        _check_int("grpo.iterations", self.iterations, 1, "e.g. 1 (on-policy) or 2")
        if not isinstance(self.rewards, list):
            raise ConfigError(f"grpo.rewards={self.rewards!r} must be [[grpo.rewards]] tables with function and weight")
        if not self.rewards:
            raise ConfigError(
                'grpo.rewards is empty; give at least one [[grpo.rewards]] table, e.g. function = "exact_answer"'
            )
        object.__setattr__(self, "rewards", [_reward_spec(i, entry) for i, entry in enumerate(self.rewards)])

    @property
    def upper_epsilon(self) -> float:
        """The upper clipping bound's epsilon: epsilon_high, or epsilon when unset."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def _check_int(name: str, value: Any, low: int, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}={value!r} must be an integer >= {low}, {example}")


def _check_number(name: str, value: Any, wanted: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name}={value!r} must be {wanted}")


def _reward_spec(index: int, entry: Any) -> RewardSpec:
    """A ``[[grpo.rewards]]`` table (or a RewardSpec) checked: a function to find and a finite weight."""
    where = f"grpo.rewards[{index}]"
    if isinstance(entry, RewardSpec):
        entry = {"function": entry.function, "weight": entry.weight}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} is {entry!r}; each entry is a table with function and weight")
    unknown = set(entry) - {"function", "weight"}
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {sorted(unknown)}; an entry has function and weight")
    function, weight = entry.get("function"), entry.get("weight", 1.0)
    if not isinstance(function, str) or not function.strip():
        raise ConfigError(
            f'{where}.function={function!r} must name a reward: a built-in {list(BUILTIN_REWARDS)} or "module:function"'
        )
    if ":" in function:
        module, _, name = function.rpartition(":")
        if not module or not name.isidentifier():
            raise ConfigError(
                f'{where}.function={function!r} must be "module:function" (e.g. "my_rewards:brevity") or a '
                f"built-in {list(BUILTIN_REWARDS)}"
            )
    elif function not in BUILTIN_REWARDS:
        raise ConfigError(
            f'{where}.function={function!r} is no built-in {list(BUILTIN_REWARDS)}; give one, or "module:function"'
        )
    _check_number(f"{where}.weight", weight, "a finite number, e.g. 1.0")
    return RewardSpec(function, float(weight))
